"""The pieces learn, not just run: tiny models trained on toy tasks solve them.

Tokens: 0 pad, 1 start/[CLS], 2 eos/[SEP], 3 [MASK] / separator, 4.. symbols.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import SamplingParams, beam_search, build_model, generate
from model.quant.int8 import quantize_int8_
from tests.conftest import tiny_config

SYMBOLS = list(range(4, 14))
ARCH = dict(vocab_size=14, d_model=64, n_heads=4, d_ff=128, max_positions=32)


def random_seqs(g: torch.Generator, n: int, lo: int = 3, hi: int = 7) -> list[list[int]]:
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.tensor(SYMBOLS)[torch.randint(0, len(SYMBOLS), (k,), generator=g)].tolist() for k in lengths]


def pad(rows: list[list[int]], value: int = 0) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def train(model, batch_fn, steps: int, lr: float = 3e-3) -> float:
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = batch_fn(model, g)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return sum(losses[-10:]) / 10


def test_encoder_decoder_learns_to_reverse():
    model = build_model(tiny_config("encoder-decoder", **ARCH, dropout=0.0)).init_weights(0)

    def batch(m, g):
        seqs = random_seqs(g, 64)
        src = pad([s + [2] for s in seqs])
        tgt_in = pad([[1] + s[::-1] for s in seqs])
        tgt_out = pad([s[::-1] + [2] for s in seqs], value=-100)
        logits = m(src, tgt_in, src_mask=src != 0)
        return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=-100)

    assert train(model, batch, steps=300) < 0.05
    test = random_seqs(torch.Generator().manual_seed(99), 16)
    sources = [s + [2] for s in test]
    greedy = generate(model, sources, SamplingParams(max_new_tokens=10, temperature=0.0))
    assert [r.token_ids for r in greedy] == [s[::-1] + [2] for s in test]
    assert all(r.finish_reason == "eos" for r in greedy)
    beams = beam_search(model, sources, beam_size=3, max_new_tokens=10)
    assert [r.token_ids for r in beams] == [s[::-1] for s in test]  # beam hypotheses exclude EOS

    # the optional int8 projections keep the learned behaviour
    assert quantize_int8_(model) > 0
    int8 = generate(model, sources, SamplingParams(max_new_tokens=10, temperature=0.0))
    assert sum(r.token_ids == s[::-1] + [2] for r, s in zip(int8, test)) >= 15


def test_decoder_lm_learns_to_copy():
    model = build_model(tiny_config("decoder", **ARCH)).init_weights(0)

    def batch(m, g):
        seqs = random_seqs(g, 64)
        rows = [[1] + s + [3] + s + [2] for s in seqs]
        ids = pad(rows)
        target = ids[:, 1:].clone()
        for i, s in enumerate(seqs):  # only the copy (after the separator) is predictable
            target[i, : len(s) + 1] = -100
        target[ids[:, 1:] == 0] = -100
        logits = m(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)

    assert train(model, batch, steps=300) < 0.05
    test = random_seqs(torch.Generator().manual_seed(98), 16)
    res = generate(model, [[1] + s + [3] for s in test], SamplingParams(max_new_tokens=10, temperature=0.0))
    assert [r.token_ids for r in res] == [s + [2] for s in test]


def test_masked_lm_learns_to_fill_from_context():
    model = build_model(tiny_config("encoder", **ARCH, mask_token_id=3)).init_weights(0)

    def masked_batch(g, n=64):
        seqs = random_seqs(g, n, lo=5, hi=6)  # fixed length: the copy sits at a fixed offset
        rows = [[1] + s + [2] + s + [2] for s in seqs]
        ids = pad(rows)
        labels = torch.full_like(ids, -100)
        for i, s in enumerate(seqs):  # mask one or two tokens of the second copy
            for j in torch.randperm(len(s), generator=g)[: 1 + i % 2].tolist():
                pos = len(s) + 2 + j
                labels[i, pos] = ids[i, pos]
                ids[i, pos] = 3
        return ids, labels

    def batch(m, g):
        ids, labels = masked_batch(g)
        logits = m(ids, attention_mask=ids != 0)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    assert train(model, batch, steps=300) < 0.05
    ids, labels = masked_batch(torch.Generator().manual_seed(97), 32)
    with torch.inference_mode():
        pred = model(ids, attention_mask=ids != 0).argmax(-1)
    where = labels != -100
    assert torch.equal(pred[where], labels[where])
