"""The encoder core: fill-mask and sentence embeddings for a list of jobs, in one padded batch.

The encoder family's counterpart of ``model.engine.EngineCore``, without a scheduler: an
encoder reads a whole text at once, so a batch is every queued text packed into padded rows
(``MaskedLM.encode_rows``), one forward pass, and every job answered from its hidden states:
fill-mask jobs from the rows at their masks (top-k over the vocabulary, special tokens never
offered, optionally re-ranked by a causal LM: ``model.encoder.rescore``), embedding jobs from
the pooled rows (the checkpoint's pooling, from its sentence-transformers config), normalised
or raw. Pure PyTorch, synchronous: the service's ``EncoderEngine`` adds the queue, the batching
window, the thread and the metrics.

    >>> from model import load_model
    >>> from model.encoder import EncoderCore
    >>> core = EncoderCore(load_model("weights/fill-mask-en"))
    >>> [c["token_str"] for c in core.fill_mask(["The capital of France is [MASK]."], top_k=3)[0][0]]
    >>> core.embed(["Hello world", "Hallo Welt"])  # two lists of d floats, each of L2 norm 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from model.formats.checkpoint import Checkpoint
from model.formats.sentence_transformers import truncating
from model.nn.transformer import MaskedLM

JOB_KINDS = ("fill_mask", "embed", "embed_raw")
Candidate = dict[str, Any]  # Hugging Face's fill-mask fields: score, token, token_str, sequence


@dataclass(eq=False)
class EncoderJob:
    """One request's texts as token-id rows. ``kind``: "fill_mask", "embed" (L2-normalised) or
    "embed_raw" (as pooled); ``texts``: fill-mask only, the texts as sent, which the rescorer reads."""

    kind: str
    rows: list[list[int]]
    top_k: int = 0
    texts: list[str] | None = None


class EncoderCore:
    """A loaded encoder checkpoint (masked LM or sentence encoder) answering batches of jobs."""

    def __init__(self, ckpt: Checkpoint, max_len: int | None = None, rescorer=None):
        """``max_len``: the longest row (default the model's positions), never beyond the
        checkpoint's trained length (sentence-transformers' ``max_seq_length``). ``rescorer``: a
        ``model.encoder.rescore.FillRescorer`` that re-ranks one-mask texts (fill-mask models only)."""
        if not isinstance(ckpt.model, MaskedLM):
            raise ValueError(f"{ckpt.path}: an encoder core needs an encoder model, not {type(ckpt.model).__name__}")
        if ckpt.tokenizer is None:
            raise ValueError(f"{ckpt.path}: an encoder core needs the model's tokenizer")
        self.ckpt, self.model, self.cfg, self.tokenizer = ckpt, ckpt.model.eval(), ckpt.config, ckpt.tokenizer
        self.max_len = min(max_len or self.cfg.max_positions, self.cfg.max_input_tokens or self.cfg.max_positions)
        self.mask_id = self.cfg.mask_token_id if self.cfg.mlm_head else None
        self.mask_token = self.tokenizer.id_to_token(self.mask_id) if self.mask_id is not None else None
        if rescorer is not None and self.mask_id is None:
            raise ValueError("a fill-mask rescorer needs a model with a masked-LM head")
        self.rescorer = rescorer
        # [CLS], [SEP], [PAD], [MASK]... are never offered as fill-mask candidates
        self._special = torch.tensor(sorted(self.tokenizer.special_ids), dtype=torch.long, device=self.model.device)

    # --- for a notebook ------------------------------------------------------------------
    def encode(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids of each text, special tokens included; longer than ``max_len`` is an error,
        or (``truncate``) cut to it as sentence-transformers does."""
        if truncate:
            return truncating(self.tokenizer, self.max_len).encode_batch(texts)
        rows = self.tokenizer.encode_batch(texts)
        for i, ids in enumerate(rows):
            if len(ids) > self.max_len:
                raise ValueError(f"text[{i}] is {len(ids)} tokens; this model reads at most {self.max_len}")
        return rows

    def fill_mask(self, texts: list[str], top_k: int = 5) -> list[list[list[Candidate]]]:
        """Per text, per mask: the ``top_k`` candidates, best first (re-ranked where a rescorer is set).

        >>> core.fill_mask(["I drink a cup of [MASK] every morning."], top_k=2)[0][0][0]["token_str"]
        """
        rows = self.encode(texts)
        self.check_masks(rows)
        return self.run([EncoderJob("fill_mask", rows, top_k, list(texts))])[0]

    def embed(self, texts: list[str], normalize: bool | None = None, truncate: bool = True) -> list[list[float]]:
        """Sentence embeddings (the checkpoint's pooling over real tokens), L2-normalised when
        ``normalize`` (default: the checkpoint's ``normalize_embeddings``); inputs cut at
        ``max_len`` unless ``truncate`` is false (then too long is an error)."""
        normalize = self.cfg.normalize_embeddings if normalize is None else normalize
        return self.run([EncoderJob("embed" if normalize else "embed_raw", self.encode(texts, truncate))])[0]

    def check_masks(self, rows: list[list[int]]) -> None:
        """ValueError unless the model has a masked-LM head and every row holds its mask token."""
        if self.mask_id is None:
            raise ValueError("an embedding model without a masked-LM head cannot fill masks")
        for i, ids in enumerate(rows):
            if self.mask_id not in ids:
                raise ValueError(f"text[{i}] must contain the mask token {self.mask_token}")

    def warmup(self) -> None:
        self.run([EncoderJob("embed", [self.tokenizer.encode("warm up the engine")])])

    # --- one batch -----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, jobs: list[EncoderJob]) -> list[Any]:
        """Every job's answer from one pass over all their rows: fill-mask, per text per mask
        the candidates; embeddings, one list of floats per text."""
        rows = [r for job in jobs for r in job.rows]
        hidden, pooled = self.model.encode_rows(rows)  # per row (T_i, d); (B, d)
        results, start = [], 0
        for job in jobs:
            part = slice(start, start + len(job.rows))
            start += len(job.rows)
            if job.kind == "embed":
                results.append(F.normalize(pooled[part], dim=-1).tolist())
            elif job.kind == "embed_raw":
                results.append(pooled[part].tolist())
            elif job.kind == "fill_mask":
                results.append(self._fill(job, hidden[part]))
            else:
                raise ValueError(f"unknown encoder job kind {job.kind!r} (one of {', '.join(JOB_KINDS)})")
        return results

    def _fill(self, job: EncoderJob, hidden: list[torch.Tensor]) -> list[list[list[Candidate]]]:
        where = [(row, pos) for row, ids in enumerate(job.rows) for pos, t in enumerate(ids) if t == self.mask_id]
        at_masks = torch.stack([hidden[row][pos] for row, pos in where])  # (n_masks, d)
        logits = self.model.lm_head(at_masks).float()  # (n_masks, V)
        logits[:, self._special] = float("-inf")
        logp = logits.log_softmax(-1)
        rescored = self._rescored(job, where)
        wanted = max(job.top_k, self.rescorer.spec.candidates) if rescored else job.top_k
        top_logp, top_tokens = logp.topk(min(wanted, logp.size(-1)), dim=-1)
        ranked = [list(zip(sc, tk)) for sc, tk in zip(top_logp.exp().tolist(), top_tokens.tolist())]
        if rescored:
            ranked = self._rerank(job, where, rescored, ranked, top_logp)
        out: list[list[list[Candidate]]] = [[] for _ in job.rows]
        for (row, pos), row_ranked in zip(where, ranked):
            candidates = []
            for score, token in row_ranked[:job.top_k]:
                filled = list(job.rows[row])
                filled[pos] = token
                candidates.append({"score": score, "token": token,
                                   "token_str": self.tokenizer.decode([token]).strip(),
                                   "sequence": self.tokenizer.decode(filled)})
            out[row].append(candidates)
        return out

    def _rescored(self, job: EncoderJob, where: list[tuple[int, int]]) -> list[int]:
        """Indices into ``where`` of the masks the rescorer re-ranks: each the only mask of its text,
        the text as sent holding the mask token once."""
        if self.rescorer is None or job.texts is None:
            return []
        per_row = [0] * len(job.rows)
        for row, _ in where:
            per_row[row] += 1
        return [i for i, (row, _) in enumerate(where)
                if per_row[row] == 1 and job.texts[row].count(self.mask_token) == 1]

    def _rerank(self, job: EncoderJob, where, rescored: list[int], ranked: list[list[tuple[float, int]]],
                top_logp: torch.Tensor) -> list[list[tuple[float, int]]]:
        """The rescorer's order and scores for the masks it takes: every candidate ``_fill``
        drew (the rescorer's number, or ``top_k`` where larger), so the scores still descend."""
        words = [[self.tokenizer.id_to_token(t) for _, t in ranked[i]] for i in rescored]
        orders = self.rescorer.rerank([job.texts[where[i][0]] for i in rescored], self.mask_token, words,
                                      [top_logp[i].tolist() for i in rescored])
        ranked = list(ranked)
        for i, order in zip(rescored, orders):
            ranked[i] = [(score, ranked[i][j][1]) for j, score in order]
        return ranked
