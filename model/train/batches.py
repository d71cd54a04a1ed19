"""Tokenised training data and a deterministic, resumable order of batches.

The batch a rank sees at a step is a pure function of (seed, step, rank, world size):
epoch ``e`` shuffles with a generator seeded by ``seed + e``, and global batch number
``step * world + rank`` is read from that sequence. A resumed run needs only the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from model.tokenization.tokenizer import Tokenizer

IGNORE = -100  # label value that the losses skip


@dataclass
class TranslationExamples:
    src: list[list[int]]  # source ids, ending in </s> (the tokenizer's template)
    tgt: list[list[int]]  # target ids, no specials

    def lengths(self) -> list[int]:
        return [max(len(s), len(t) + 1) for s, t in zip(self.src, self.tgt)]


def encode_pairs(tok: Tokenizer, pairs: Sequence[dict], max_len: int) -> TranslationExamples:
    src = tok.encode_batch([p["source"] for p in pairs])
    tgt = tok.encode_batch([p["target"] for p in pairs], add_special_tokens=False)
    keep = [i for i in range(len(src)) if len(src[i]) <= max_len and len(tgt[i]) + 1 <= max_len]
    return TranslationExamples([src[i] for i in keep], [tgt[i] for i in keep])


def encode_documents(tok: Tokenizer, texts: Sequence[str], bos: int, eos: int) -> list[int]:
    """One token stream: ``<s> doc </s> <s> doc </s> ...`` in corpus order."""
    stream: list[int] = []
    for ids in tok.encode_batch(list(texts), add_special_tokens=False):
        stream += [bos, *ids, eos]
    return stream


def lm_blocks(stream: list[int], block: int) -> Tensor:
    """Cut the stream into (N, block + 1) rows overlapping by one token (input + shifted label)."""
    n = (len(stream) - 1) // block
    if n < 1:
        raise ValueError(f"only {len(stream)} tokens: not enough for one block of {block}")
    t = torch.tensor(stream[: n * block + 1], dtype=torch.long)
    return t.unfold(0, block + 1, block)  # (N, block + 1)


def encode_sentences(tok: Tokenizer, texts: Sequence[str], max_len: int) -> list[list[int]]:
    """``[CLS] text [SEP]`` sequences; a long text is cut into several of at most ``max_len``."""
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    room = max_len - 2
    out = []
    for ids in tok.encode_batch(list(texts), add_special_tokens=False):
        for start in range(0, max(len(ids), 1), room):
            piece = ids[start: start + room]
            if piece:
                out.append([cls_id, *piece, sep_id])
    return out


def token_batches(lengths: Sequence[int], batch_tokens: int, gen: torch.Generator, pool: int = 64) -> list[list[int]]:
    """Shuffle, then sort pools of examples by length and cut batches of at most ``batch_tokens``
    padded tokens, then shuffle the batches: little padding, still a random order."""
    order = torch.randperm(len(lengths), generator=gen).tolist()
    batches: list[list[int]] = []
    approx = max(1, batch_tokens // max(1, sum(lengths) // max(1, len(lengths))))
    step = approx * pool
    for start in range(0, len(order), step):
        chunk = sorted(order[start: start + step], key=lambda i: lengths[i])
        cur: list[int] = []
        longest = 0
        for i in chunk:
            longest_if = max(longest, lengths[i])
            if cur and longest_if * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, longest_if = [], lengths[i]
            cur.append(i)
            longest = longest_if
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def fixed_batches(n: int, batch_size: int, gen: torch.Generator) -> list[list[int]]:
    """Shuffled batches of exactly ``batch_size`` (the remainder of an epoch is dropped)."""
    order = torch.randperm(n, generator=gen).tolist()
    return [order[i: i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


class BatchOrder:
    """Global batch number -> list of example indices, over as many epochs as needed."""

    def __init__(self, make_epoch: Callable[[torch.Generator], list[list[int]]], seed: int):
        self.make_epoch, self.seed = make_epoch, seed
        self._epoch_sizes: list[int] = []
        self._cached: tuple[int, list[list[int]]] | None = None

    def _epoch(self, e: int) -> list[list[int]]:
        if self._cached is None or self._cached[0] != e:
            batches = self.make_epoch(torch.Generator().manual_seed(self.seed + e))
            if not batches:
                raise ValueError("an epoch has no batches: the training set is smaller than one batch")
            self._cached = (e, batches)
        return self._cached[1]

    def batch(self, index: int) -> tuple[int, list[int]]:
        """(epoch, example indices) of global batch ``index``."""
        e, start = 0, 0
        while True:
            if e == len(self._epoch_sizes):
                self._epoch_sizes.append(len(self._epoch(e)))
            if index < start + self._epoch_sizes[e]:
                return e, self._epoch(e)[index - start]
            start += self._epoch_sizes[e]
            e += 1


def pad(seqs: Sequence[Sequence[int]], value: int) -> Tensor:
    out = torch.full((len(seqs), max(len(s) for s in seqs)), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out


def translation_batch(ex: TranslationExamples, idx: Sequence[int], pad_id: int, bos: int, eos: int
                      ) -> dict[str, Tensor]:
    """Teacher forcing: decoder input ``<s> y``, labels ``y </s>`` (shifted by one)."""
    src = pad([ex.src[i] for i in idx], pad_id)  # (B, S)
    dec_in = pad([[bos, *ex.tgt[i]] for i in idx], pad_id)  # (B, T)
    labels = pad([[*ex.tgt[i], eos] for i in idx], IGNORE)  # (B, T)
    return {"src": src, "src_mask": src != pad_id, "dec_in": dec_in, "labels": labels}


def lm_batch(blocks: Tensor, idx: Sequence[int]) -> dict[str, Tensor]:
    rows = blocks[list(idx)]  # (B, block + 1)
    return {"ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}


def mask_tokens(ids: Tensor, special: Tensor, mask_id: int, vocab_size: int, prob: float,
                gen: torch.Generator, first_regular_id: int = 0) -> tuple[Tensor, Tensor]:
    """BERT masking: choose ``prob`` of the non-special tokens; of those 80% become [MASK],
    10% a random (non-special) token, 10% stay. Returns (inputs, labels: IGNORE where not chosen)."""
    chosen = (torch.rand(ids.shape, generator=gen) < prob) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE))
    roll = torch.rand(ids.shape, generator=gen)
    random_ids = torch.randint(first_regular_id, vocab_size, ids.shape, generator=gen)
    inputs = torch.where(chosen & (roll < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
    return inputs, labels


def mlm_batch(seqs: Sequence[Sequence[int]], idx: Sequence[int], pad_id: int, special_ids: Sequence[int],
              mask_id: int, vocab_size: int, prob: float, gen: torch.Generator) -> dict[str, Tensor]:
    ids = pad([seqs[i] for i in idx], pad_id)  # (B, T)
    special = torch.isin(ids, torch.tensor(list(special_ids)))
    inputs, labels = mask_tokens(ids, special, mask_id, vocab_size, prob, gen, max(special_ids) + 1)
    return {"ids": inputs, "attention_mask": ids != pad_id, "labels": labels}
