"""Held-out metrics, each next to trivial baselines measured the same way.

- translation: sacreBLEU BLEU and chrF of greedy (and beam) output on the test split,
  against copying the source, emitting the most frequent training translation, and a
  word-for-word glossary built from the training pairs;
- causal LM: test perplexity against a unigram model of the training tokens;
- masked LM: top-1 / top-5 accuracy on masked test tokens against always guessing the
  most frequent training tokens.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import sacrebleu
import torch
import torch.nn.functional as F

from model import beam_search, generate
from model.engine.sampling import SamplingParams
from model.nn.transformer import DecoderLM, EncoderDecoder, MaskedLM
from model.text.placeholders import placeholders, same_placeholders
from model.text.translate import Attempt, Decoded, translate
from model.text.translate import sources as placeholder_sources
from model.tokenization.tokenizer import Tokenizer
from model.train.batches import IGNORE, encode_documents, encode_sentences, lm_blocks, pad

WORD = re.compile(r"\w+|[^\w\s]+")
RETRY_BEAMS = 4  # beam search for the greedy outputs whose placeholders did not map back


def bleu_chrf(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    return {"bleu": round(sacrebleu.corpus_bleu(list(hyps), [list(refs)]).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(list(hyps), [list(refs)]).score, 2)}


class Glossary:
    """Word-for-word baseline: each English word becomes the German word most often given
    for it as a one-word training pair; unknown words are copied."""

    def __init__(self, train_pairs: Sequence[dict]):
        votes: dict[str, Counter] = defaultdict(Counter)
        for p in train_pairs:
            if WORD.fullmatch(p["source"]) and WORD.fullmatch(p["target"]):
                votes[p["source"].lower()][p["target"]] += 1
        self.table = {w: c.most_common(1)[0][0] for w, c in votes.items()}

    def translate(self, text: str) -> str:
        return " ".join(self.table.get(w.lower(), w) for w in WORD.findall(text))


def translate_all(model: EncoderDecoder, tok: Tokenizer, sources: Sequence[str], max_new_tokens: int,
                  beam_size: int = 1, batch_size: int = 64, step=None) -> list[str]:
    """Translations of ``sources``, through the placeholder-safe sequence the service runs too
    (``model.text.translate``): a checkpoint trained on masked placeholders sees them masked;
    an output that lost a sentinel is decoded again with beam search (4) when the first
    decoding was greedy, and if that fails too the first output's placeholders are restored as
    far as they survived (the greedy metrics stay those of greedy output). ``step``: the decode
    step (``model.decode.prepare``); None: the model's own float Python step."""
    masking = bool(model.cfg.mask_placeholders)

    def decode(attempt: Attempt) -> list[Decoded[None]]:
        beams = RETRY_BEAMS if attempt.retry else beam_size
        outs = _translate(model, tok, attempt.texts, max_new_tokens, beams, batch_size, step)
        return [Decoded([out], None) for out in outs]

    done = translate(placeholder_sources(sources, masking), decode, masking, retry=beam_size == 1,
                     restore_from="first")
    return [r.text for r in done]


def _translate(model: EncoderDecoder, tok: Tokenizer, sources: Sequence[str], max_new_tokens: int,
               beam_size: int, batch_size: int, step=None) -> list[str]:
    limit = min(max_new_tokens, model.cfg.max_positions - 1)
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))  # similar lengths batch well
    texts: dict[int, str] = {}
    chunk = batch_size if beam_size == 1 else max(1, batch_size // beam_size)
    for start in range(0, len(order), chunk):
        idx = order[start: start + chunk]
        ids = [tok.encode(sources[i])[: model.cfg.max_positions] for i in idx]
        if beam_size == 1:
            results = generate(model, ids, SamplingParams(max_new_tokens=limit, temperature=0.0), tok, step=step)
        else:
            results = beam_search(model, ids, beam_size=beam_size, max_new_tokens=limit, tokenizer=tok, step=step)
        for i, r in zip(idx, results):
            texts[i] = tok.decode(r.token_ids, skip_special_tokens=True).strip()
    return [texts[i] for i in range(len(sources))]


def eval_subset(records: Sequence[dict], limit: int | None) -> list[dict]:
    """At most ``limit`` records, chosen by the sha256 of their source (a spread over every
    package, not the first ones in corpus order), in that hash order."""
    ranked = sorted(records, key=lambda r: hashlib.sha256(r["source"].encode("utf-8")).digest())
    return ranked[:limit] if limit else ranked


def placeholder_preservation(sources: Sequence[str], outputs: Sequence[str]) -> dict[str, Any]:
    """Share of strings whose output has exactly the source's placeholders: over the strings
    that have any, and over all strings (an invented placeholder counts as a failure)."""
    same = [same_placeholders(s, o) for s, o in zip(sources, outputs)]
    having = [ok for s, ok in zip(sources, same) if placeholders(s)]
    return {"strings_with_placeholders": len(having),
            "preserved": round(sum(having) / len(having), 4) if having else None,
            "preserved_all_strings": round(sum(same) / max(1, len(same)), 4)}


def heldout_metrics(model: EncoderDecoder, tok: Tokenizer, records: Sequence[dict], max_new_tokens: int,
                    others: dict[str, tuple[EncoderDecoder, Tokenizer]]) -> dict[str, Any]:
    """Greedy BLEU/chrF and placeholder preservation of this model, of each model in
    ``others`` (e.g. the previous version) and of copying the source, on the same records."""
    sources, refs = [p["source"] for p in records], [p["target"] for p in records]
    systems = {"model_greedy": (model, tok), **others}
    out: dict[str, Any] = {"sentences": len(records)}
    for name, (m, t) in systems.items():
        m.eval()
        hyps = translate_all(m, t, sources, max_new_tokens)
        out[name] = {**bleu_chrf(hyps, refs), "placeholders": placeholder_preservation(sources, hyps)}
    out["copy_source"] = bleu_chrf(sources, refs)
    out["signatures"] = {}
    for name, metric in (("bleu", sacrebleu.BLEU()), ("chrf", sacrebleu.CHRF())):
        metric.corpus_score(sources, [refs])  # the signature names the reference count once scored
        out["signatures"][name] = str(metric.get_signature())
    return out


def translation_metrics(model: EncoderDecoder, tok: Tokenizer, test: Sequence[dict], train: Sequence[dict],
                        max_new_tokens: int, beam_size: int, beam_sentences: int) -> dict[str, Any]:
    sources, refs = [p["source"] for p in test], [p["target"] for p in test]
    model.eval()
    greedy = translate_all(model, tok, sources, max_new_tokens)
    most_frequent = Counter(p["target"] for p in train).most_common(1)[0][0]
    glossary = Glossary(train)
    metrics: dict[str, Any] = {
        "test_sentences": len(test),
        "model_greedy": bleu_chrf(greedy, refs),
        "baselines": {
            "copy_source": bleu_chrf(sources, refs),
            "most_frequent_translation": {**bleu_chrf([most_frequent] * len(refs), refs), "output": most_frequent},
            "word_for_word_glossary": bleu_chrf([glossary.translate(s) for s in sources], refs),
        },
        "placeholders": placeholder_preservation(sources, greedy),
        "examples": [{"source": s, "reference": r, "model": h} for s, r, h in list(zip(sources, refs, greedy))[:8]],
    }
    if beam_size > 1 and beam_sentences > 0:
        n = min(beam_sentences, len(sources))
        beam = translate_all(model, tok, sources[:n], max_new_tokens, beam_size=beam_size)
        metrics[f"model_beam{beam_size}_first{n}"] = bleu_chrf(beam, refs[:n])
        metrics[f"model_greedy_first{n}"] = bleu_chrf(greedy[:n], refs[:n])
    return metrics


@torch.no_grad()
def lm_metrics(model: DecoderLM, tok: Tokenizer, test_texts: Sequence[str], train_stream: Sequence[int],
               block: int, batch_size: int = 16) -> dict[str, Any]:
    """Perplexity over every test token after the first, in blocks of ``block`` tokens."""
    model.eval()
    bos, eos = model.cfg.bos_token_id, model.cfg.eos_token_id
    blocks = lm_blocks(encode_documents(tok, test_texts, bos, eos), block)  # (N, block + 1)
    nll, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        rows = blocks[i: i + batch_size].to(model.device)
        logits = model(rows[:, :-1]).float()  # (B, T, V)
        nll += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1), reduction="sum"))
        count += rows[:, 1:].numel()
    # Unigram baseline over the same predicted tokens (add-one smoothing over the vocabulary).
    counts = torch.bincount(torch.tensor(list(train_stream)), minlength=tok.vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    targets = blocks[:, 1:].reshape(-1)
    uni_nll = float(-logp[targets].sum())
    return {"test_tokens": count, "model_perplexity": round(math.exp(nll / count), 2),
            "baselines": {"unigram_perplexity": round(math.exp(uni_nll / count), 2)}}


def sample_text(model: DecoderLM, tok: Tokenizer, prompts: Sequence[str], max_new_tokens: int = 60) -> list[str]:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_k=40, seed=7)
    results = generate(model, [tok.encode(p) for p in prompts], params, tok)
    return [p + r.text for p, r in zip(prompts, results)]


@torch.no_grad()
def mlm_metrics(model: MaskedLM, tok: Tokenizer, test_texts: Sequence[str], train_seqs: Sequence[Sequence[int]],
                max_len: int, mask_prob: float, batch_size: int = 32, seed: int = 0) -> dict[str, Any]:
    """Top-1/top-5 accuracy at masked positions (all replaced by [MASK]) of the test split."""
    model.eval()
    pad_id, mask_id = model.cfg.pad_token_id, model.cfg.mask_token_id
    special_ids = torch.tensor(sorted(tok.special_ids))
    seqs = encode_sentences(tok, test_texts, max_len)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(tok.vocab_size, dtype=torch.long)
    for s in train_seqs:
        counts += torch.bincount(torch.tensor(s), minlength=tok.vocab_size)
    counts[special_ids] = 0
    frequent = counts.topk(5).indices  # (5,)
    hit1 = hit5 = base1 = base5 = total = 0
    for i in range(0, len(seqs), batch_size):
        ids = pad(seqs[i: i + batch_size], pad_id)  # (B, T)
        special = torch.isin(ids, special_ids)
        # prob 1.0 of [MASK] among chosen: evaluation hides every chosen token.
        chosen = (torch.rand(ids.shape, generator=gen) < mask_prob) & ~special
        labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE))
        inputs = torch.where(chosen, torch.full_like(ids, mask_id), ids)
        logits = model(inputs.to(model.device), (ids != pad_id).to(model.device)).float().cpu()  # (B, T, V)
        at = labels != IGNORE
        gold = labels[at]  # (M,)
        top5 = logits[at].topk(5, dim=-1).indices  # (M, 5)
        hit1 += int((top5[:, 0] == gold).sum())
        hit5 += int((top5 == gold[:, None]).any(-1).sum())
        base1 += int((gold == frequent[0]).sum())
        base5 += int(torch.isin(gold, frequent).sum())
        total += int(gold.numel())
    return {"masked_tokens": total, "model_top1": round(hit1 / total, 4), "model_top5": round(hit5 / total, 4),
            "baselines": {"most_frequent_top1": round(base1 / total, 4), "most_frequent_top5": round(base5 / total, 4),
                          "most_frequent_tokens": [tok.id_to_token(int(t)) for t in frequent]}}
