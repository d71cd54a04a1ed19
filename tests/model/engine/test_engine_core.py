"""The engine core (plan -> run -> update), stepped by hand: joins and leaves between steps give
exactly what each request would get alone."""

from __future__ import annotations

import pytest
import torch

from model import SamplingParams, beam_search, generate
from model.engine import EngineCore, EngineRequest
from tests.conftest import tiny_model


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run_until_done(sched: EngineCore, arrivals: dict[int, list[EngineRequest]] | None = None,
                   max_steps: int = 500) -> dict[str, list[int]]:
    """Step the scheduler, adding ``arrivals[step]`` before that step; collect token ids."""
    arrivals = arrivals or {}
    out: dict[str, list[int]] = {}
    for step in range(max_steps):
        for req in arrivals.get(step, []):
            sched.add(req)
        if not sched.has_work and step > max(arrivals, default=0):
            return out
        for event in sched.step().events:
            assert event.error is None
            out.setdefault(event.request_id, []).extend(event.token_ids)
    raise AssertionError("scheduler did not finish")


@pytest.fixture(scope="module")
def lm():
    return tiny_model("decoder", seed=11, max_positions=64)


@pytest.fixture(scope="module")
def mt():
    return tiny_model("encoder-decoder", seed=12, max_positions=64)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 61, (int(k),), generator=g).tolist() for k in torch.randint(1, 20, (n,), generator=g)]


def test_requests_joining_and_leaving_match_solo_generation(lm):
    ps = prompts(7)
    lengths = [3, 9, 1, 14, 6, 11, 2]
    sched = EngineCore(lm, None, n_slots=3, max_len=48)  # fewer slots than requests: some wait
    arrivals = {0: [], 2: [], 5: []}
    for i, (p, n) in enumerate(zip(ps, lengths)):
        arrivals[[0, 2, 5][i % 3]].append(EngineRequest(f"r{i}", p, greedy(n)))
    out = run_until_done(sched, arrivals)
    for i, (p, n) in enumerate(zip(ps, lengths)):
        assert out[f"r{i}"] == generate(lm, [p], greedy(n))[0].token_ids
    assert sched.slots_used == 0 and sorted(sched.scheduler.free) == [0, 1, 2]


def test_chunked_prefill_gives_the_same_tokens(lm):
    ps = prompts(4, seed=1)
    ps[0] = ps[0] * 3  # a long prompt that needs several chunks
    whole = EngineCore(lm, None, n_slots=4, max_len=64)
    chunked = EngineCore(lm, None, n_slots=4, max_len=64, max_prefill_tokens=5)
    reqs = lambda: {0: [EngineRequest(f"r{i}", p, greedy(6)) for i, p in enumerate(ps)]}  # noqa: E731
    assert run_until_done(whole, reqs()) == run_until_done(chunked, reqs())


def test_prefill_budget_spreads_admission_over_steps(lm):
    sched = EngineCore(lm, None, n_slots=4, max_len=64, max_prefill_tokens=8)
    for i in range(3):
        sched.add(EngineRequest(f"r{i}", list(range(3, 13)), greedy(2)))  # 10 tokens each
    first = sched.step()
    assert first.prompt_tokens == 8 and len(first.events) == 0  # one chunk, nobody finished prefill
    assert len(sched.scheduler.prefilling) == 1 and sched.num_waiting == 2


def test_seeded_sampling_matches_offline_generate(lm):
    ps = prompts(3, seed=2)
    params = [SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    sched = EngineCore(lm, None, n_slots=2, max_len=48)
    out = run_until_done(sched, {0: [EngineRequest(f"r{i}", p, q) for i, (p, q) in enumerate(zip(ps, params))]})
    for i, (p, q) in enumerate(zip(ps, params)):
        assert out[f"r{i}"] == generate(lm, [p], q)[0].token_ids


def test_beam_and_greedy_requests_share_steps(mt):
    srcs = prompts(4, seed=3)
    sched = EngineCore(mt, None, n_slots=9, max_len=16, max_src_len=32)
    beam = SamplingParams(max_new_tokens=8, beam_size=3, length_penalty=1.0)
    reqs = [EngineRequest("b0", srcs[0], beam), EngineRequest("g1", srcs[1], greedy(8)),
            EngineRequest("b2", srcs[2], beam), EngineRequest("g3", srcs[3], greedy(5))]
    out = run_until_done(sched, {0: reqs[:2], 1: reqs[2:]})
    assert out["b0"] == beam_search(mt, [srcs[0]], beam_size=3, max_new_tokens=8)[0].token_ids
    assert out["b2"] == beam_search(mt, [srcs[2]], beam_size=3, max_new_tokens=8)[0].token_ids
    assert out["g1"] == generate(mt, [srcs[1]], greedy(8))[0].token_ids
    assert out["g3"] == generate(mt, [srcs[3]], greedy(5))[0].token_ids
    assert sched.slots_used == 0


def test_abort_frees_slots_at_once_and_others_are_unaffected(lm):
    ps = prompts(2, seed=4)
    sched = EngineCore(lm, None, n_slots=2, max_len=48)
    sched.add(EngineRequest("keep", ps[0], greedy(10)))
    sched.add(EngineRequest("drop", ps[1], greedy(30)))
    got = []
    for _ in range(3):
        got += [t for e in sched.step().events if e.request_id == "keep" for t in e.token_ids]
    assert sched.slots_used == 2
    assert sched.abort("drop") and sched.slots_used == 1
    sched.add(EngineRequest("next", ps[1], greedy(4)))  # reuses the freed slot
    out = run_until_done(sched)
    assert got + out["keep"] == generate(lm, [ps[0]], greedy(10))[0].token_ids
    assert out["next"] == generate(lm, [ps[1]], greedy(4))[0].token_ids
    assert not sched.abort("drop")  # unknown ids are a no-op


def test_deadline_expiry_fails_waiting_and_running_requests(lm):
    sched = EngineCore(lm, None, n_slots=1, max_len=48)
    sched.add(EngineRequest("running", [5, 6], greedy(30), deadline=10.0))
    sched.add(EngineRequest("waiting", [5, 6], greedy(30), deadline=10.0))
    sched.step()
    assert sched.expire(now=5.0) == []
    events = sched.expire(now=11.0)
    assert sorted(e.request_id for e in events) == ["running", "waiting"]
    assert all(e.error == "timeout" for e in events)
    assert not sched.has_work and sched.slots_used == 0


def test_stop_at_eos_frees_the_slot(lm):
    # find the greedy continuation, then declare its 3rd token a stop token id
    p = prompts(1, seed=5)[0]
    tokens = generate(lm, [p], greedy(6))[0].token_ids
    sched = EngineCore(lm, None, n_slots=1, max_len=48)
    sched.add(EngineRequest("r", p, greedy(6, stop_token_ids=[tokens[2]])))
    out = run_until_done(sched)
    assert out["r"] == tokens[: tokens.index(tokens[2]) + 1]
    assert sched.slots_used == 0


@pytest.mark.parametrize("family", ["lm", "mt"])
def test_finished_sequences_leave_no_holes_so_decode_reads_are_views(family, lm, mt, monkeypatch):
    """Sequences finishing out of order are moved down into the freed slots: every decode
    batch of plain sequences covers slots 0..B-1 (a slice of the cache, no gather), and
    the moves change nothing in what each request gets."""
    model = lm if family == "lm" else mt
    ps = prompts(6, seed=9)
    lengths = [12, 2, 7, 1, 15, 4]  # short ones finish first and leave holes below long ones
    sched = EngineCore(model, None, n_slots=6, max_len=48, max_src_len=24 if family == "mt" else 0)
    batches = []
    decode_step = sched.runner.step

    def spy(cache, tokens, slots, positions):
        batches.append(list(slots))
        return decode_step(cache, tokens, slots, positions)

    monkeypatch.setattr(sched.runner, "step", spy)
    out = run_until_done(sched, {0: [EngineRequest(f"r{i}", p, greedy(n)) for i, (p, n) in
                                     enumerate(zip(ps, lengths))]})
    monkeypatch.undo()
    assert any(len(b) < len(ps) for b in batches)  # sequences did leave in between
    assert all(b == list(range(len(b))) for b in batches), batches
    for i, (p, n) in enumerate(zip(ps, lengths)):
        assert out[f"r{i}"] == generate(model, [p], greedy(n))[0].token_ids


def test_a_beam_moved_into_a_freed_slot_keeps_its_history(mt):
    ps = prompts(3, seed=10)
    sched = EngineCore(mt, None, n_slots=5, max_len=48, max_src_len=24)
    beam = SamplingParams(max_new_tokens=12, beam_size=3, length_penalty=1.0)
    # slots: short 0, long 1, beam 2-4; when short finishes, a beam slot moves down into 0
    reqs = [EngineRequest("short", ps[0], greedy(2)), EngineRequest("long", ps[2], greedy(14)),
            EngineRequest("beam", ps[1], beam)]
    out = run_until_done(sched, {0: reqs})
    assert out["short"] == generate(mt, [ps[0]], greedy(2))[0].token_ids
    assert out["long"] == generate(mt, [ps[2]], greedy(14))[0].token_ids
    assert out["beam"] == beam_search(mt, [ps[1]], beam_size=3, max_new_tokens=12)[0].token_ids
