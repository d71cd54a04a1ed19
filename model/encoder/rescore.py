"""Fill-mask candidates re-ranked by a causal language model.

A small masked LM reads both sides of the mask but has seen little English: ``fill-mask-en``
(MiniLM, 22M parameters, fine-tuned here on ~120k sentences) gets 28% of held-out everyday
sentences right on its own. A causal LM trained on trillions of tokens (Gemma 3 270M) knows far
more English but reads left to right. So the masked LM proposes ``candidates`` words and the
causal LM judges each filled-in text:

    score(w) = mlm_weight * log P_mlm(w | text) + log P_lm(w's tokens and the next ``context``
               tokens | the text before the mask)

The causal LM's term covers the word itself and a few tokens after it, so the right-hand context
counts too ("She opened the [MASK] and walked into the room."); the text before the mask is the
same for every candidate and cancels. The scores returned are a softmax of ``score`` over the
candidates, scaled to the probability mass the masked LM gave them, so a response's candidates
and any beyond ``candidates`` (in the masked LM's order) still sum to at most 1.

Limits (named in docs/limits.md): one mask per text is re-ranked (a text with several masks
gets the masked LM's answers); the causal LM reads at most ``LEFT_CONTEXT`` tokens before the
mask; the masked LM's vocabulary is uncased, so a word is scored capitalised at the start of a
sentence, and elsewhere in the case the causal LM prefers there (``cased``).

The causal LM runs through the decode step the service would give it (``model.decode.prepare``):
the native int8 step's prompt path where it runs (``NativeStep.prefill_rows``), else the model's
float forward.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model.formats.checkpoint import Checkpoint, RescoreSpec

LEFT_CONTEXT = 96  # causal-LM tokens kept before the first token that differs between candidates
ROWS_PER_CALL = 64  # logit rows per forward pass: rows x vocabulary floats (Gemma: 64 MiB)
_SENTENCE_END = re.compile(r"(^|[.!?][\"')\]]*\s+)[\"'(\[]*$")


def filled(text: str, mask: str, word: str) -> str:
    """``text`` with its (single) ``mask`` replaced by ``word`` as the causal LM should read it:
    capitalised at the start of a sentence, a ``##`` continuation glued to the word before."""
    at = text.index(mask)
    before, after = text[:at], text[at + len(mask):]
    if word.startswith("##") and len(word) > 2:
        return before.rstrip() + word[2:] + after
    if _SENTENCE_END.search(before):
        word = word[:1].upper() + word[1:]
    return before + word + after


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def _common_suffix(seqs: Sequence[Sequence[int]], prefix: int) -> int:
    n = min(len(s) for s in seqs) - prefix
    for i in range(n):
        if any(s[-1 - i] != seqs[0][-1 - i] for s in seqs):
            return i
    return max(n, 0)


@dataclass
class _Scored:
    """One candidate text cut to what is scored: ``ids`` run through the LM; the logits of rows
    ``first - 1 .. len(ids) - 1`` score tokens ``first .. len(ids)`` of the full text."""

    ids: list[int]
    first: int
    targets: list[int]


def _scored_spans(seqs: list[list[int]], context: int) -> list[_Scored]:
    """Per candidate text (token ids, BOS first): the tokens that differ and ``context`` after."""
    start = max(_common_prefix(seqs), 1)
    tail = _common_suffix(seqs, start)
    cut = max(start - 1 - LEFT_CONTEXT, 0)  # keep BOS and LEFT_CONTEXT tokens before `start`
    out = []
    for s in seqs:
        end = min(len(s), len(s) - tail + context)  # one past the last token scored
        out.append(_Scored(s[:1] + s[1 + cut:end - 1], start - cut, s[start:end]))
    return out


class FillRescorer:
    """Re-ranks a masked LM's candidates with a causal LM (module docstring)."""

    def __init__(self, lm: Checkpoint, spec: RescoreSpec, options=None, step=None, lock=None):
        """``options``: the decode options of the service (default ``DecodeOptions()``). Under
        the native step the LM scores through its ``prefill_rows``, and ``prepare`` drops the
        float copies that only the Python path reads (``model.decode.native.drop_float_copies``:
        Gemma 3 270M holds 1.3 GB instead of 2.7 GB) unless ``prefill='model'``.

        ``step``: a decode step already prepared for ``lm.model`` (a served decoder's, shared
        rather than loaded twice); ``options`` then go unused. ``lock``: held around every pass
        through the LM, so that another thread stepping the same decode step (the served
        decoder's engine: the native plan is not reentrant) never runs at the same time."""
        from model.decode import DecodeOptions, prepare
        from model.decode.native import NativeStep
        from model.nn.transformer import DecoderLM

        if not isinstance(lm.model, DecoderLM):
            raise ValueError(f"{spec.model}: the fill-mask rescorer must be a decoder-only language model, "
                             f"not {type(lm.model).__name__}")
        if lm.tokenizer is None:
            raise ValueError(f"{spec.model}: the fill-mask rescorer needs its tokenizer")
        self.lm, self.spec = lm, spec
        self.model = lm.model.eval()
        self.shared = step is not None
        if step is None:
            step = prepare(self.model, options or DecodeOptions(), lm.tokenizer)
        self.native = step if isinstance(step, NativeStep) else None
        self.kv_dtype = step.kv_dtype
        self.bos = lm.config.bos_token_id
        self._lock = lock if lock is not None else contextlib.nullcontext()

    @classmethod
    def load(cls, spec: RescoreSpec, options=None, device: str | torch.device = "cpu") -> FillRescorer:
        from model import load_model
        from model.formats.checkpoint import CheckpointError

        try:
            lm = load_model(spec.model, device)
        except CheckpointError as exc:
            raise CheckpointError(f"the fill-mask rescorer '{spec.model.name}' cannot be loaded ({exc}); "
                                  "TSERVE_FILL_MASK_RESCORE=false serves the masked LM without it") from exc
        return cls(lm, spec, options)

    @property
    def extra_bytes(self) -> int:
        """Bytes the decode step holds beyond the causal LM's own tensors."""
        return int(getattr(self.native, "extra_bytes", 0) or 0)


    # --- scoring ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        ids = self.lm.tokenizer.encode(text, add_special_tokens=False)
        return ([self.bos] if self.bos is not None else []) + ids

    @torch.inference_mode()
    def logprobs(self, groups: Sequence[Sequence[str]]) -> list[list[float]]:
        """Per group of alternative texts (one sentence with different words at one place): the
        causal LM's log-probability of each text's differing tokens and ``context`` tokens after."""
        spans = [_scored_spans([self.encode(t) for t in texts], self.spec.context) for texts in groups]
        flat = [s for group in spans for s in group]
        totals = self._score(flat)
        out, at = [], 0
        for group in spans:
            out.append(totals[at:at + len(group)])
            at += len(group)
        return out

    def _score(self, spans: list[_Scored]) -> list[float]:
        totals = [0.0] * len(spans)
        batch: list[int] = []
        rows = 0
        for i, s in enumerate(spans):
            n = len(s.targets)
            if batch and rows + n > ROWS_PER_CALL:
                self._run(spans, batch, totals)
                batch, rows = [], 0
            if n:
                batch.append(i)
                rows += n
        if batch:
            self._run(spans, batch, totals)
        return totals

    def _run(self, spans: list[_Scored], batch: list[int], totals: list[float]) -> None:
        parts = [spans[i] for i in batch]
        logits = self._logits(parts)
        targets = torch.tensor([t for p in parts for t in p.targets], dtype=torch.long, device=logits.device)
        picked = logits.float().log_softmax(-1).gather(-1, targets[:, None])[:, 0].tolist()
        at = 0
        for i, p in zip(batch, parts):
            totals[i] = sum(picked[at:at + len(p.targets)])
            at += len(p.targets)

    def _logits(self, parts: list[_Scored]) -> torch.Tensor:
        """The logits of each part's rows ``first - 1 .. len(ids) - 1``, parts after each other."""
        with self._lock:
            return self._native_logits(parts) if self.native is not None else self._float_logits(parts)

    def _native_logits(self, parts: list[_Scored]) -> torch.Tensor:
        cache = self.model.new_cache(len(parts), max(len(p.ids) for p in parts) + 1, dtype=self.kv_dtype)
        for slot, p in enumerate(parts):
            cache.ensure(slot, len(p.ids))
        rows, offset = [], 0
        for p in parts:
            rows.extend(range(offset + p.first - 1, offset + len(p.ids)))
            offset += len(p.ids)
        return self.native.prefill_rows(cache, [p.ids for p in parts], list(range(len(parts))), rows)

    def _float_logits(self, parts: list[_Scored]) -> torch.Tensor:
        width = max(len(p.ids) for p in parts)
        device = self.model.device
        pad = self.model.cfg.pad_token_id or 0
        ids = torch.tensor([p.ids + [pad] * (width - len(p.ids)) for p in parts], device=device)
        real = torch.tensor([[1] * len(p.ids) + [0] * (width - len(p.ids)) for p in parts], device=device)
        hidden = self.model.hidden_states(ids, attention_mask=real)
        picked = torch.cat([hidden[i, p.first - 1:len(p.ids)] for i, p in enumerate(parts)])
        return self.model.lm_head(picked)

    @torch.inference_mode()
    def cased(self, texts: Sequence[str], mask: str, words: Sequence[Sequence[str]]) -> list[list[str]]:
        """The masked LM's words (lower case) as the causal LM would write them after the text
        before the mask: capitalised where the LM's next-token distribution prefers the
        capitalised word's first token ("The capital of France is" -> "Paris"), else as they are.
        One logit row per text. A word at the start of a sentence is capitalised by ``filled``."""
        out = [list(ws) for ws in words]
        asked = [i for i, t in enumerate(texts) if not _SENTENCE_END.search(t[:t.index(mask)])]
        if not asked:
            return out
        befores = [texts[i][:texts[i].index(mask)] for i in asked]
        parts = [_Scored(ids, len(ids), []) for ids in (self.encode(b.rstrip()) for b in befores)]
        logp = torch.cat([self._logits(parts[b:b + ROWS_PER_CALL])
                          for b in range(0, len(parts), ROWS_PER_CALL)]).float().log_softmax(-1)
        for row, (i, before) in enumerate(zip(asked, befores)):
            space = " " if before[-1:].isspace() else ""
            asked_words = [(j, w) for j, w in enumerate(words[i]) if w.isalpha() and w.islower()]
            forms = self.lm.tokenizer.encode_batch([space + f for _, w in asked_words for f in (w, w.capitalize())],
                                                   add_special_tokens=False)  # one call per text
            for (j, w), low, cap in zip(asked_words, forms[::2], forms[1::2]):
                if low and cap and low[0] != cap[0] and logp[row, cap[0]] > logp[row, low[0]]:
                    out[i][j] = w.capitalize()
        return out

    # --- re-ranking ------------------------------------------------------------------------
    def rerank(self, texts: Sequence[str], mask: str, words: Sequence[Sequence[str]],
               mlm_logprobs: Sequence[Sequence[float]]) -> list[list[tuple[int, float]]]:
        """Per text (with exactly one ``mask``): its candidates' indices, best first, with their
        scores (module docstring)."""
        lm = self.logprobs([[filled(t, mask, w) for w in ws] for t, ws in zip(texts, self.cased(texts, mask, words))])
        out = []
        for mlm, lps in zip(mlm_logprobs, lm):
            mlm_t = torch.tensor(mlm, dtype=torch.float64)
            combined = self.spec.mlm_weight * mlm_t + torch.tensor(lps, dtype=torch.float64)
            probs = combined.softmax(-1) * mlm_t.exp().sum()
            order = probs.argsort(descending=True).tolist()
            out.append([(i, float(probs[i])) for i in order])
        return out
