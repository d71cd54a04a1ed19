"""Sampling: reproducible seeds, allowed sets for top-k/top-p, greedy limits."""

from __future__ import annotations

import pytest
import torch

from model import SamplingParams, generate
from model.engine.sampling import Sampler, apply_repetition_penalty, filter_top_k_top_p, greedy_tokens, make_generator

VOCAB = 40


def draws(logits, params, n, seed):
    sampler = Sampler()
    gen = make_generator(seed, "cpu")
    return torch.stack([sampler(logits, [params], [gen]).tokens for _ in range(n)]).flatten()


def test_top_k_never_leaves_the_k_most_likely(fresh_seed):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(fresh_seed))
    allowed = set(logits[0].topk(5).indices.tolist())
    seen = set(draws(logits, SamplingParams(temperature=1.5, top_k=5), 2000, fresh_seed).tolist())
    assert seen <= allowed, f"seed {fresh_seed}"
    assert len(seen) == 5  # and it does use all of them at a high temperature


def test_top_p_never_leaves_the_nucleus(fresh_seed):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(fresh_seed)) * 3
    probs = logits.softmax(-1)[0]
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[mass_before < 0.7].tolist())
    seen = set(draws(logits, SamplingParams(top_p=0.7), 2000, fresh_seed).tolist())
    assert seen <= nucleus, f"seed {fresh_seed}"


def test_top_k_and_top_p_per_row_in_one_batch():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    out = filter_top_k_top_p(logits, torch.tensor([1, 0, 3]), torch.tensor([1.0, 1e-6, 1.0]))
    kept = torch.isfinite(out).sum(-1).tolist()
    assert kept == [1, 1, 3]  # top-1; a tiny nucleus keeps the argmax; top-3
    assert out[0].argmax() == logits[0].argmax()


def test_a_top_k_past_the_vocabulary_keeps_every_token_and_draws_as_none():
    """Any size a client writes (7e34 once overflowed int64 and failed the engine's whole step):
    past the vocabulary it is the same as no top-k, draw for draw."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    for k in (VOCAB + 1, 2**63, 7 * 10**34):
        params = [SamplingParams(temperature=1.0, top_k=k, seed=5), SamplingParams(temperature=1.0, top_k=2, seed=6)]
        got = Sampler()(logits, params, [make_generator(5, "cpu"), make_generator(6, "cpu")]).tokens
        plain = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1.0, top_k=2, seed=6)]
        want = Sampler()(logits, plain, [make_generator(5, "cpu"), make_generator(6, "cpu")]).tokens
        assert torch.equal(got, want), k


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    tokens = draws(probs.log(), SamplingParams(), 6000, seed=7)
    freq = torch.bincount(tokens, minlength=3).float() / len(tokens)
    assert torch.allclose(freq, probs[0], atol=0.03)


def test_temperature_zero_is_greedy_and_low_temperature_approaches_it():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(-1)
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 4)
    assert torch.equal(out.tokens, greedy)
    cold = Sampler()(logits, [SamplingParams(temperature=1e-4, seed=s) for s in range(4)],
                     [make_generator(s, "cpu") for s in range(4)])
    assert torch.equal(cold.tokens, greedy)


def test_repetition_penalty_follows_the_ctrl_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_seeded_generation_is_reproducible_alone_and_in_a_batch(decoder_lm):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True)
              for s in (11, 12, 13)]
    first = generate(decoder_lm, prompts, params)
    again = generate(decoder_lm, prompts, params)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    alone = generate(decoder_lm, [prompts[1]], [params[1]])[0]
    assert alone.token_ids == first[1].token_ids
    other_seed = generate(decoder_lm, [prompts[1]], [SamplingParams(max_new_tokens=10, seed=99, ignore_eos=True)])
    assert other_seed[0].token_ids != alone.token_ids


def test_logprobs_are_the_models_distribution(decoder_lm):
    params = SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    res = generate(decoder_lm, [[5, 6, 7]], params)[0]
    assert len(res.logprobs) == 4 and len(res.top_logprobs) == 4
    full = decoder_lm(torch.tensor([[5, 6, 7] + res.token_ids]))[0].log_softmax(-1)
    for step, tok in enumerate(res.token_ids):
        expected = full[2 + step, tok].item()
        assert res.logprobs[step] == pytest.approx(expected, abs=1e-5)
        top = res.top_logprobs[step]
        assert list(top) == full[2 + step].topk(3).indices.tolist()
        assert tok in top  # greedy picks the top token


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("max_new_tokens", 0),
    ("repetition_penalty", 0.0), ("stop", ["a", "b", "c", "d", "e"]), ("logprobs", 21), ("logprobs", True),
    ("logprobs", 2.5), ("beam_size", 0),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.8), (-1.0, 0.5)])
def test_presence_and_frequency_penalties_follow_openai_rule(decoder_lm, presence, frequency):
    """Greedy decoding through the engine equals a by-hand loop over full recomputation that
    subtracts presence * [count > 0] + frequency * count of the generated tokens only."""
    prompt = [5, 9, 9, 12]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency)
    got = generate(decoder_lm, [prompt], params)[0].token_ids
    seq, counts = list(prompt), torch.zeros(decoder_lm.cfg.vocab_size)
    with torch.no_grad():
        for _ in range(12):
            logits = decoder_lm(torch.tensor([seq]))[0, -1] - presence * (counts > 0) - frequency * counts
            tok = int(logits.argmax())
            counts[tok] += 1
            seq.append(tok)
    assert got == seq[len(prompt):]
    plain = generate(decoder_lm, [prompt], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    if presence > 0 or frequency > 0:
        assert len(set(got)) >= len(set(plain[0].token_ids))  # penalties spread the choice of tokens


def test_a_penalised_request_batched_with_plain_ones_decodes_as_alone(decoder_lm):
    """Only rows with a penalty keep their token history up to date; a penalised request that
    shares its steps with plain ones (and follows one in the same slot) gets the tokens it gets
    alone."""
    from model import EngineCore, EngineRequest

    penalised = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=1.5,
                               frequency_penalty=0.5, repetition_penalty=1.3)
    plain = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = [5, 9, 9, 12]

    def run(requests):
        core = EngineCore(decoder_lm, None, n_slots=2, max_len=64)
        out = {rid: [] for rid, _, _ in requests}
        for rid, p, params in requests:
            core.add(EngineRequest(rid, list(p), params))
        while core.has_work:
            for event in core.step().events:
                out[event.request_id] += event.token_ids
        return out

    alone = run([("x", prompt, penalised)])["x"]
    mixed = run([("a", [7, 7, 3], plain), ("b", [4, 4, 4, 4], plain), ("x", prompt, penalised)])
    assert mixed["x"] == alone
    assert mixed["a"] == run([("a", [7, 7, 3], plain)])["a"]
    assert alone != run([("x", prompt, plain)])["x"]  # the penalties do change this request's tokens


def test_greedy_tokens_pick_the_first_of_equal_maxima_as_argmax_does():
    """The engine's greedy choice (max with indices) is argmax's on every kind of row: ties
    (first index), NaN, infinities, a row of -inf, a constant row, and random rows."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 1_000, generator=gen)
    x[0, [5, 700]] = 9.0
    x[1, 17] = float("nan")
    x[2, [9, 900]] = float("inf")
    x[3] = float("-inf")
    x[4] = 1.0
    x[5, 999] = 50.0
    x[6, [0, 999]] = -float("inf")
    x[7, [3, 4]] = float("nan")
    picked = greedy_tokens(x)
    assert torch.equal(picked, x.argmax(dim=-1))
    assert picked[:6].tolist() == [5, 17, 9, 0, 0, 999]
    assert torch.equal(greedy_tokens(x.double()), x.double().argmax(dim=-1))
