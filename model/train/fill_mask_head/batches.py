"""Whole-word masking and the batches both trainers draw."""

from __future__ import annotations

import random

import torch

MAX_LEN = 64  # wordpieces per training sentence, [CLS]/[SEP] included


def mask_words(ids: list[int], offsets: list[tuple[int, int]], word_ids: list[int | None], rng: random.Random,
               mask_id: int, prob: float) -> tuple[list[int], list[int], list[int]]:
    """Whole-word masking: ~``prob`` of the words (at least one), every wordpiece of each -> [MASK]."""
    words = sorted({w for w in word_ids if w is not None})
    n = max(1, round(prob * len(words)))
    chosen = set(rng.sample(words, min(n, len(words))))
    positions = [i for i, w in enumerate(word_ids) if w in chosen]
    masked = list(ids)
    for i in positions:
        masked[i] = mask_id
    return masked, positions, [ids[i] for i in positions]


def mask_for_training(ids: list[int], word_ids: list[int | None], rng: random.Random, mask_id: int,
                      prob: float, random_ids: int, keep: float, swap: float) -> tuple[list[int], list[int], list[int]]:
    """Whole-word masking with BERT's rule: ~``prob`` of the words (at least one) are chosen; each
    chosen wordpiece becomes [MASK], or a random wordpiece (``swap``), or stays (``keep``)."""
    masked, positions, targets = mask_words(ids, [], word_ids, rng, mask_id, prob)
    masked = list(masked)
    for i in positions:
        r = rng.random()
        if r < keep:
            masked[i] = ids[i]
        elif r < keep + swap:
            masked[i] = FIRST_PLAIN_ID + rng.randrange(random_ids - FIRST_PLAIN_ID)
    return masked, positions, targets


FIRST_PLAIN_ID = 999  # BERT's uncased vocabulary: [PAD], [unused*], [UNK], [CLS], [SEP], [MASK] come first


def pad_batch(items: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(m) for m in items)
    ids = torch.zeros(len(items), T, dtype=torch.long)
    real = torch.zeros(len(items), T, dtype=torch.bool)
    for j, m in enumerate(items):
        ids[j, :len(m)] = torch.tensor(m)
        real[j, :len(m)] = True
    return ids, real


def epoch_batches(rows: list[dict], epoch: int, seed: int, batch: int, python_fraction: float) -> list[list[int]]:
    """One epoch's batches of row indices: every sentence but the Python docs' (a random
    ``python_fraction`` of those), shuffled, sorted by length within chunks of 50 batches (little
    padding), the batches shuffled again."""
    rng = random.Random(f"{seed}:{epoch}")
    idx = [i for i, r in enumerate(rows) if not r["python"] or rng.random() < python_fraction]
    rng.shuffle(idx)
    chunk = batch * 50
    batches = []
    for c in range(0, len(idx), chunk):
        part = sorted(idx[c:c + chunk], key=lambda i: len(rows[i]["ids"]))
        batches += [part[b:b + batch] for b in range(0, len(part), batch)]
    rng.shuffle(batches)
    return batches


def finetune_rows(tk, texts: list[dict]) -> list[dict]:
    encs = tk.tk.encode_batch([r["text"] for r in texts])
    return [{"ids": e.ids, "word_ids": e.word_ids, "python": r["doc"].startswith("python3.11-doc:")}
            for r, e in zip(texts, encs)]
