"""Speculative decoding (prompt lookup): the drafter finds what followed the current suffix;
verification keeps greedy outputs and logprobs equal to decoding without drafts (alone, in a
batch with sequences that do not draft, and through preemption), and keeps the sampling
distribution (the accept/reject rule, checked against exact probabilities)."""

from __future__ import annotations

import copy

import pytest
import torch

from model import SamplingParams
from model.engine import EngineCore, EngineRequest
from model.engine.speculative import MAX_WAIT, NgramDrafter, SpeculativeConfig, verify
from tests.conftest import tiny_model
from tests.model.engine.test_paged_cache import block_bytes, drain

SPEC = SpeculativeConfig(tokens=4, max_batch=64)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("decoder", seed=11, max_positions=2048, positional="rope", norm="rmsnorm", mlp="gated",
                      n_heads=4, n_kv_heads=2, activation="silu")


def test_the_drafter_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    cfg = SpeculativeConfig(ngram_min=1, ngram_max=3)
    d = NgramDrafter([5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 6, 7], cfg)
    d.kept = d.tried = 1.0  # every draft kept so far: it drafts as many as it may
    # suffix (6, 7): its latest earlier occurrence is followed by 3, 4; (3,4,6,7)... is not indexed
    assert d.propose(2) == [3, 4]
    assert d.propose(10) == [3, 4, 6, 7]  # up to the end of what is known
    d.extend([8])  # suffix (6, 7, 8) occurred at the start: 9, 1, 2 followed
    assert d.propose(3) == [9, 1, 2]
    assert NgramDrafter([1, 2, 3, 4], cfg).propose(4) == []  # nothing repeats
    assert NgramDrafter([1, 2, 3, 1, 2], SpeculativeConfig(ngram_min=3, ngram_max=3)).propose(4) == []


def test_a_drafter_whose_drafts_are_refused_waits_longer_each_time_and_resets_when_one_is_kept():
    d = NgramDrafter([1, 2, 1, 2, 1, 2], SpeculativeConfig(ngram_min=1))
    waits = []
    for _ in range(6):
        d.settle(drafted=3, accepted=0)
        waits.append(d.wait)
    assert waits == [1, 3, 7, 15, 31, MAX_WAIT]
    assert [d.propose(2) for _ in range(MAX_WAIT)] == [[]] * MAX_WAIT  # waiting: no drafts
    assert d.propose(2) == [1]  # drafting again, one token at a time after so many refusals
    d.settle(drafted=2, accepted=1)
    d.settle(drafted=2, accepted=0)
    assert d.wait == 1  # the wait starts again from one step


def test_a_sequence_drafts_more_tokens_the_more_of_them_are_kept():
    d = NgramDrafter([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], SpeculativeConfig(tokens=4))
    for _ in range(6):
        d.settle(drafted=4, accepted=4)
    assert d.length() == 4 and d.propose(8) == [3, 4, 5, 6]
    for _ in range(10):  # one draft kept in three runs: one at a time pays best
        d.settle(drafted=4, accepted=0)
        d.settle(drafted=4, accepted=0)
        d.settle(drafted=4, accepted=1)
    d.wait = 0
    assert d.length() == 1 and d.propose(8) == [3]
    lengths = []
    for _ in range(4):
        d.settle(drafted=2, accepted=2)
        lengths.append(d.length())
    assert lengths == sorted(lengths) and lengths[-1] > 1


def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's test at p > 0.001 over the categories the model gives mass (none drawn outside)."""
    n = counts.sum()
    expected = probs * n
    if (counts[probs == 0] > 0).any():
        return False
    keep = expected > 0
    stat = (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum().item()
    dof = int(keep.sum()) - 1
    # the 0.999 quantile of chi-square(dof), by the Wilson-Hilferty approximation
    z = 3.090
    quantile = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    return stat < quantile


@pytest.mark.parametrize("top_k", [0, 3], ids=["full", "top_k=3"])
def test_verification_keeps_the_sampling_distribution(top_k):
    """One draft per sequence, 20,000 sequences at once: the first token emitted is distributed
    as p0 (the draft accepted with probability p0(d), else a draw from p0 without d), and after
    an accepted draft the next one as p1; each against the exact probabilities."""
    torch.manual_seed(1234)
    v, n = 7, 20_000
    logits0, logits1 = torch.randn(v) * 1.5, torch.randn(v) * 1.5
    draft = int(logits0.argsort()[-2])  # a likely token, not the likeliest: both branches occur
    params = SamplingParams(temperature=0.8, top_k=top_k)
    rows = torch.stack([logits0, logits1]).repeat(n, 1)
    out = verify(rows, [[draft]] * n, [params] * n, [None] * n)

    def exact(logits):
        scaled = logits / 0.8
        if top_k:
            scaled = torch.where(scaled >= scaled.topk(top_k).values[-1], scaled, float("-inf"))
        return scaled.softmax(-1)

    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=v).float()
    assert _chi_square_ok(first, exact(logits0))
    after = [o[1] for o in out if len(o) == 2]
    assert all(o[0] == draft for o in out if len(o) == 2) and len(after) > 2500
    assert _chi_square_ok(torch.bincount(torch.tensor(after), minlength=v).float(), exact(logits1))


def _oracle(monkeypatch, references: dict[tuple[int, ...], list[int]], corrupt_every: int, vocab: int):
    """Drafts from the reference continuation of each prompt, every ``corrupt_every``-th draft
    changed: the verifier meets full runs, partial runs and refusals."""
    calls = {"n": 0}

    def propose(self, limit):
        prompt = next(p for p in references if tuple(self.tokens[:len(p)]) == p)
        full = references[prompt]
        out = list(full[len(self.tokens): len(self.tokens) + limit])
        for i in range(len(out)):
            calls["n"] += 1
            if calls["n"] % corrupt_every == 0:
                out[i] = (out[i] + 1) % vocab
        return out

    monkeypatch.setattr(NgramDrafter, "propose", propose)


def _requests(model, n: int, new: int, **params) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        prompt = torch.randint(3, model.cfg.vocab_size, (20 + 5 * i,), generator=g).tolist()
        out.append(EngineRequest(str(i), prompt, SamplingParams(max_new_tokens=new, ignore_eos=True, **params)))
    return out


def token_events(core: EngineCore, reqs: list[EngineRequest]) -> dict[str, tuple[list[int], list[float]]]:
    """Each request's token ids and logprobs, the core stepped until it has no work (no errors)."""
    for r in reqs:
        core.add(r)
    out = {r.request_id: ([], []) for r in reqs}
    while core.has_work:
        for e in core.step().events:
            assert e.error is None
            out[e.request_id][0].extend(e.token_ids)
            out[e.request_id][1].extend(e.logprobs)
    return out


def test_greedy_with_drafts_equals_greedy_without_tokens_and_logprobs(llama, monkeypatch):
    """Four sequences decode with drafts (every third one wrong) next to two that never draft
    (a repetition penalty): every stream, and its logprobs, equals the run without drafts."""
    reqs = _requests(llama, 4, 40, temperature=0.0, logprobs=2)
    reqs += [EngineRequest(f"p{i}", r.prompt_ids, SamplingParams(max_new_tokens=30, temperature=0.0,
                                                                  repetition_penalty=1.3, ignore_eos=True))
             for i, r in enumerate(reqs[:2])]
    plain = EngineCore(llama, None, n_slots=8, max_len=256)
    expected = token_events(plain, copy.deepcopy(reqs))
    references = {tuple(r.prompt_ids): r.prompt_ids + expected[r.request_id][0] for r in reqs[:4]}
    _oracle(monkeypatch, references, corrupt_every=3, vocab=llama.cfg.vocab_size)
    spec = EngineCore(llama, None, n_slots=8, max_len=256, speculative=SPEC)
    got = token_events(spec, copy.deepcopy(reqs))
    assert spec.accepted_tokens > 40 and spec.drafted_tokens > spec.accepted_tokens  # both branches ran
    for rid, (tokens, logprobs) in expected.items():
        assert got[rid][0] == tokens, rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(logprobs), atol=1e-4, rtol=0)
    # each drafting sequence took fewer steps than tokens
    assert spec.cache.pool.used == 0


def test_drafts_through_preemption_give_the_uninterrupted_output(llama, monkeypatch):
    """Six sequences with drafts in a pool of 12 blocks: preempted and resumed many times,
    every stream equals the roomy run without drafts."""
    reqs = _requests(llama, 6, 48, temperature=0.0)
    roomy = EngineCore(llama, None, n_slots=6, max_len=256)
    expected, errors = drain(roomy, copy.deepcopy(reqs))
    assert not errors
    references = {tuple(r.prompt_ids): r.prompt_ids + expected[r.request_id] for r in reqs}
    _oracle(monkeypatch, references, corrupt_every=4, vocab=llama.cfg.vocab_size)
    tight = EngineCore(llama, None, n_slots=6, max_len=256, kv_cache_bytes=(1 + 12) * block_bytes(llama),
                       speculative=SPEC)
    got, errors = drain(tight, copy.deepcopy(reqs))
    assert not errors
    assert tight.scheduler.preemptions >= 3 and tight.accepted_tokens > 20
    assert got == expected
    assert tight.cache.pool.used == 0


def test_drafting_stops_at_max_tokens_and_at_a_stop_token(llama, monkeypatch):
    """A run of kept drafts that passes max_tokens or a stop token is cut there, as without drafts."""
    base = _requests(llama, 1, 25, temperature=0.0)[0]
    plain = token_events(EngineCore(llama, None, n_slots=2, max_len=256), [copy.deepcopy(base)])["0"][0]
    stop_at = plain[13]
    reqs = [EngineRequest("len", base.prompt_ids, SamplingParams(max_new_tokens=25, temperature=0.0,
                                                                 ignore_eos=True)),
            EngineRequest("stop", base.prompt_ids, SamplingParams(max_new_tokens=25, temperature=0.0,
                                                                  stop_token_ids=[stop_at], ignore_eos=True))]
    references = {tuple(base.prompt_ids): base.prompt_ids + plain}
    _oracle(monkeypatch, references, corrupt_every=10**9, vocab=llama.cfg.vocab_size)
    got = token_events(EngineCore(llama, None, n_slots=2, max_len=256, speculative=SPEC), reqs)
    assert got["len"][0] == plain
    assert got["stop"][0] == plain[: plain.index(stop_at) + 1]


def test_real_prompt_lookup_keeps_greedy_output_on_a_repetitive_prompt(llama):
    """No oracle: the n-gram drafter on a prompt that repeats itself, and a random model that
    falls into loops; outputs equal, and drafts were kept."""
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(3, llama.cfg.vocab_size, (9,), generator=g).tolist()
    reqs = [EngineRequest(str(i), pattern * (3 + i), SamplingParams(max_new_tokens=50, temperature=0.0,
                                                                    ignore_eos=True)) for i in range(3)]
    expected = token_events(EngineCore(llama, None, n_slots=4, max_len=256), copy.deepcopy(reqs))
    spec = EngineCore(llama, None, n_slots=4, max_len=256, speculative=SpeculativeConfig(ngram_min=1))
    got = token_events(spec, copy.deepcopy(reqs))
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in expected.items()}
    assert spec.accepted_tokens > 0


def test_seeded_sampled_sequences_do_not_draft_and_keep_their_tokens(llama, monkeypatch):
    """A seed promises the same tokens alone or in any batch; whether a step drafts depends on
    the batch, so seeded sampled requests never draft: the same tokens with drafting on or off."""
    reqs = _requests(llama, 3, 30, temperature=0.9, top_p=0.9, seed=5)
    plain = token_events(EngineCore(llama, None, n_slots=4, max_len=256), copy.deepcopy(reqs))
    references = {tuple(r.prompt_ids): r.prompt_ids + plain[r.request_id][0] for r in reqs}
    _oracle(monkeypatch, references, corrupt_every=10**9, vocab=llama.cfg.vocab_size)
    spec = EngineCore(llama, None, n_slots=4, max_len=256, speculative=SPEC)
    assert token_events(spec, copy.deepcopy(reqs)) == plain
    assert spec.drafted_tokens == 0


def test_the_sampling_distribution_through_the_engine(monkeypatch):
    """A 12-token vocabulary, 6,000 requests for three tokens sampled at temperature 0.5; after the first token a
    fixed draft is fed for the second. The second token (given the likeliest first one) and the
    third (given the draft was kept) follow the model's exact probabilities (full forward passes)."""
    model = tiny_model("decoder", seed=5, vocab_size=12, max_positions=64, positional="rope", norm="rmsnorm",
                       mlp="gated", n_heads=2, n_kv_heads=1, activation="silu")
    prompt = [3, 7, 5, 9]

    def probs(ids):
        with torch.no_grad():
            return (model(torch.tensor([ids]))[0, -1] / 0.5).softmax(-1)

    first = int(probs(prompt).argmax())
    p_second = probs(prompt + [first])
    draft = int(p_second.argsort()[-2])  # likely, not the likeliest: kept and refused both occur
    p_third = probs(prompt + [first, draft])

    def propose(self, limit):
        return [draft][:limit] if len(self.tokens) == len(prompt) + 1 else []

    monkeypatch.setattr(NgramDrafter, "propose", propose)
    torch.manual_seed(99)
    core = EngineCore(model, None, n_slots=64, max_len=16, speculative=SPEC)
    reqs = [EngineRequest(str(i), prompt, SamplingParams(max_new_tokens=3, temperature=0.5, ignore_eos=True))
            for i in range(6000)]
    got = [t for t, _ in token_events(core, reqs).values()]
    assert core.drafted_tokens == 6000
    seconds = torch.tensor([t[1] for t in got if t[0] == first])
    assert len(seconds) > 500
    assert _chi_square_ok(torch.bincount(seconds, minlength=12).float(), p_second)
    thirds = torch.tensor([t[2] for t in got if t[:2] == [first, draft]])
    assert len(thirds) > 100
    assert _chi_square_ok(torch.bincount(thirds, minlength=12).float(), p_third)
