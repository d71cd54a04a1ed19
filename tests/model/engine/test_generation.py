"""Stop handling, streaming text, and beam search."""

from __future__ import annotations

import pytest
import torch

from model import SamplingParams, SequenceTracker, beam_search, generate
from model.engine.beam_search import BeamSearch
from model.tokenization.tokenizer import train_bpe


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(["hello world, hello there. The end. Größe 🙂"] * 30, vocab_size=290)


def test_stop_string_is_cut_and_never_streamed(bpe):
    tracker = SequenceTracker(SamplingParams(max_new_tokens=50, stop=["The end"]), bpe, eos_id=2)
    events = []
    for i in bpe.encode("hello there. The end. hello", add_special_tokens=False):
        events.append(tracker.add(i))
        if tracker.finished:
            break
    streamed = "".join(e.text for e in events)
    assert streamed == "hello there. "
    assert events[-1].finish_reason == "stop"
    assert all("The" not in e.text for e in events)


def test_possible_stop_prefix_is_held_back_then_released(bpe):
    ids = bpe.encode("hello world, hello", add_special_tokens=False)
    tracker = SequenceTracker(SamplingParams(max_new_tokens=len(ids), stop=["world!"]), bpe, eos_id=2)
    streamed = ""
    for n, token in enumerate(ids):
        streamed += tracker.add(token).text
        decoded = bpe.decode(ids[: n + 1])
        if not tracker.finished:  # the last len("world!") - 1 characters could start the stop string
            assert streamed == decoded[: max(0, len(decoded) - 5)]
    assert tracker.finish_reason == "length"
    assert streamed == "hello world, hello"  # released in full at the end


def test_eos_and_stop_token_ids_and_length(bpe):
    t = SequenceTracker(SamplingParams(max_new_tokens=10), bpe, eos_id=2)
    t.add(bpe.encode("hello", add_special_tokens=False)[0])
    assert t.add(2).finish_reason == "eos"
    t = SequenceTracker(SamplingParams(max_new_tokens=10, stop_token_ids=[7]), bpe, eos_id=2)
    assert t.add(7).finish_reason == "stop"
    t = SequenceTracker(SamplingParams(max_new_tokens=2, ignore_eos=True), bpe, eos_id=2)
    assert t.add(2).finish_reason is None and t.add(2).finish_reason == "length"
    with pytest.raises(RuntimeError):
        t.add(5)


def test_generate_stops_each_sequence_on_its_own(decoder_lm):
    prompts = [[5, 6], [7, 8, 9]]
    params = [SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True)]
    res = generate(decoder_lm, prompts, params)
    assert [len(r.token_ids) for r in res] == [3, 7]
    assert all(r.finish_reason == "length" for r in res)


def test_beam_size_one_equals_greedy(encoder_decoder):
    srcs = [[5, 6, 7, 2], [8, 9, 2], [10, 11, 12, 13, 14, 2]]
    greedy = generate(encoder_decoder, srcs, SamplingParams(max_new_tokens=12, temperature=0.0))
    beam = beam_search(encoder_decoder, srcs, beam_size=1, max_new_tokens=12)
    assert [g.token_ids for g in greedy] == [b.token_ids for b in beam]


def test_beam_search_scores_are_consistent_and_batch_invariant(encoder_decoder):
    srcs = [[5, 6, 7, 2], [8, 9, 2], [10, 11, 12, 13, 14, 2]]
    beams = beam_search(encoder_decoder, srcs, beam_size=4, length_penalty=0.0, max_new_tokens=8)
    for src, res in zip(srcs, beams):
        alone = beam_search(encoder_decoder, [src], beam_size=4, length_penalty=0.0, max_new_tokens=8)[0]
        assert alone.token_ids == res.token_ids
        # the reported score is the model's log probability of the hypothesis
        tgt = [encoder_decoder.cfg.decoder_start_token_id] + res.token_ids
        logp = encoder_decoder(torch.tensor([src]), torch.tensor([tgt])).log_softmax(-1)[0]
        target = res.token_ids + ([encoder_decoder.cfg.eos_token_id] if res.finish_reason == "eos" else [])
        total = sum(logp[i, t].item() for i, t in enumerate(target))
        assert res.score == pytest.approx(total, abs=1e-4)
        greedy = generate(encoder_decoder, [src], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
        g_tgt = [encoder_decoder.cfg.decoder_start_token_id] + greedy.token_ids
        g_logp = encoder_decoder(torch.tensor([src]), torch.tensor([g_tgt])).log_softmax(-1)[0]
        g_target = greedy.token_ids + ([2] if greedy.finish_reason == "eos" else [])
        g_total = sum(g_logp[i, t].item() for i, t in enumerate(g_target))
        if greedy.finish_reason == res.finish_reason:
            assert total >= g_total - 1e-4  # beam 4 finds at least as likely a hypothesis


def test_beam_step_keeps_best_continuations_and_finishes_on_eos():
    search = BeamSearch(n_sources=1, beam_size=2, length_penalty=1.0, max_new_tokens=5, eos_id=0)
    logp = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.1, 0.6, 0.3]]))
    step = search.step(logp)  # first step: only beam 0 is real
    assert step.tokens == [1, 2] and search.beams[0] == [[1], [2]]
    # beam 0 strongly prefers EOS, beam 1 continues
    logp = torch.log(torch.tensor([[0.9, 0.05, 0.05], [0.2, 0.1, 0.7]]))
    step = search.step(logp)
    assert search.finished[0][0][1] == [1] and search.finished[0][0][2] == "eos"
    assert search.beams[0][0] == [2, 2]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_length_penalty_normalises_scores_and_decides_the_winner(length_penalty):
    """An early EOS (log .5, length 1) against a 4-token hypothesis (log .3 + 3 log .98):
    raw log probability prefers the short one; dividing by length ** penalty the long one."""
    search = BeamSearch(n_sources=1, beam_size=2, length_penalty=length_penalty, max_new_tokens=4, eos_id=0)
    search.step(torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 2)))
    while search.live:
        search.step(torch.log(torch.tensor([[0.01, 0.98, 0.01]] * 2)))
    score, tokens, reason = search.best(0)
    short = (torch.tensor(0.5).log().item(), [], "eos")
    long_sum = torch.tensor(0.3).log().item() + 3 * torch.tensor(0.98).log().item()
    long = (long_sum / 4**length_penalty, [1, 1, 1, 1], "length")
    expected = short if length_penalty == 0.0 else long
    assert (tokens, reason) == (expected[1], expected[2])
    assert score == pytest.approx(expected[0], abs=1e-6)


def test_generate_refuses_beam_params(encoder_decoder):
    with pytest.raises(ValueError, match="beam_search"):
        generate(encoder_decoder, [[5, 6, 2]], SamplingParams(max_new_tokens=4, beam_size=3))
