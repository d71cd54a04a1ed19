"""The paged KV cache under memory pressure: preempted equals uninterrupted (greedy and seeded
sampling), a request that can never fit is refused by name, beams share their history
blocks, sliding-window models give blocks back, and a long prompt read through many blocks
equals a full recomputation."""

from __future__ import annotations

import pytest
import torch

from model import SamplingParams
from model.engine import EngineCore, EngineRequest
from model.nn.kv_cache import BLOCK_LEN
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("decoder", seed=11, max_positions=2048, positional="rope", norm="rmsnorm", mlp="gated",
                      n_heads=4, n_kv_heads=2, activation="silu")


def block_bytes(model) -> int:
    return 2 * len(model.decoder_layers) * model.cfg.kv_heads * model.cfg.head_dim * BLOCK_LEN * 4


def drain(core: EngineCore, requests: list[EngineRequest]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Every request's streamed tokens (in order, as a client sees them) and errors."""
    for r in requests:
        core.add(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    errors: dict[str, str] = {}
    for _ in range(5000):
        if not core.has_work:
            break
        for event in core.step().events:
            tokens[event.request_id] += event.token_ids
            if event.error:
                errors[event.request_id] = event.error
    assert not core.has_work
    return tokens, errors


def requests(model, n: int, prompt_len: int, new: int, seeded: bool = False) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(n * 1000 + prompt_len)
    out = []
    for i in range(n):
        prompt = torch.randint(3, model.cfg.vocab_size, (prompt_len + 3 * i,), generator=g).tolist()
        params = (SamplingParams(max_new_tokens=new, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True) if seeded
                  else SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
        out.append(EngineRequest(str(i), prompt, params))
    return out


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded-sampling"])
def test_preempted_sequences_give_the_uninterrupted_output(llama, seeded):
    """Eight 40-token prompts, 48 new tokens each, in a pool of 14 blocks (about two sequences
    at full length): sequences are preempted and resumed many times, and every request's
    stream, token by token, equals the run with room for all of them."""
    roomy = EngineCore(llama, None, n_slots=8, max_len=256)
    expected, errors = drain(roomy, requests(llama, 8, 40, 48, seeded))
    assert not errors and roomy.scheduler.preemptions == 0
    tight = EngineCore(llama, None, n_slots=8, max_len=256, kv_cache_bytes=(1 + 14) * block_bytes(llama))
    got, errors = drain(tight, requests(llama, 8, 40, 48, seeded))
    assert not errors
    assert tight.scheduler.preemptions >= 4
    assert got == expected  # no token lost, repeated or changed
    assert tight.cache.pool.used == 0  # every block given back


def test_preemption_with_the_prefix_cache_keeps_outputs(llama):
    shared = torch.randint(3, llama.cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(5)).tolist()
    reqs = lambda: [EngineRequest(str(i), shared + [3 + i] * (i + 1), SamplingParams(  # noqa: E731
        max_new_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(6)]
    expected, _ = drain(EngineCore(llama, None, n_slots=6, max_len=256), reqs())
    tight = EngineCore(llama, None, n_slots=6, max_len=256, prefix_cache=True,
                       kv_cache_bytes=(1 + 16) * block_bytes(llama))
    got, errors = drain(tight, reqs())
    assert not errors and got == expected
    assert tight.scheduler.preemptions > 0 and tight.prefix.hit_tokens > 0


def test_a_request_that_can_never_fit_the_pool_is_refused_and_others_go_on(llama):
    core = EngineCore(llama, None, n_slots=4, max_len=512, kv_cache_bytes=(1 + 6) * block_bytes(llama))
    too_big = EngineRequest("big", list(range(3, 90)), SamplingParams(max_new_tokens=20, temperature=0.0))
    fits = EngineRequest("ok", list(range(3, 20)), SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                  ignore_eos=True))
    tokens, errors = drain(core, [too_big, fits])
    assert errors == {"big": "input_too_long"} and len(tokens["ok"]) == 8


def test_a_long_prompt_through_many_blocks_equals_recomputation(llama):
    """1,500 tokens (94 blocks) written in chunks: the last position's logits equal the full
    causal forward pass, and the decode steps after it too."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, llama.cfg.vocab_size, (1, 1504), generator=g)
    with torch.inference_mode():
        full = llama(ids)[0]
        cache = llama.new_cache(1, 1600, n_blocks=1 + 100)
        for start in range(0, 1500, 512):  # chunked prefill, as the engine does it
            logits = llama.prefill(cache, [ids[0, start:min(start + 512, 1500)].tolist()], [0], starts=[start])
        torch.testing.assert_close(logits[0], full[1499], atol=1e-4, rtol=1e-4)
        for p in range(1500, 1504):
            step = llama.decode_step(cache, ids[0, p:p + 1], [0], [p])
            torch.testing.assert_close(step[0], full[p], atol=1e-4, rtol=1e-4)
    assert len(cache.rows[0]) == 94


def test_beams_share_their_history_blocks():
    """Beam search forks by reference: after the first steps every hypothesis's table starts
    with the same blocks (the start token's block is copied on write, never the whole history)."""
    model = tiny_model("encoder-decoder", seed=2)
    core = EngineCore(model, None, n_slots=4, max_len=64, max_src_len=16)
    core.add(EngineRequest("beam", list(range(4, 14)), SamplingParams(max_new_tokens=40, temperature=0.0,
                                                                      beam_size=4, ignore_eos=True)))
    for _ in range(BLOCK_LEN + 4):  # past the first block boundary
        core.step()
    (seq,) = core.scheduler.running
    first = {core.cache.rows[s][0] for s in seq.slots}
    assert len(first) < 4  # some hypotheses read the same first block
    assert all(core.cache.pool.refs[b] >= 1 for b in first)
    assert sum(core.cache.pool.refs[b] for b in first) == 4


def test_beam_search_under_a_tight_pool_gives_the_same_translation():
    model = tiny_model("encoder-decoder", seed=2)
    sources = [list(range(4, 14)), list(range(20, 33)), [5, 9, 17, 30, 41]]
    reqs = lambda: [EngineRequest(str(i), s, SamplingParams(max_new_tokens=30, temperature=0.0,  # noqa: E731
                                                            beam_size=3)) for i, s in enumerate(sources)]
    expected, _ = drain(EngineCore(model, None, n_slots=9, max_len=64, max_src_len=16), reqs())
    per_block = 2 * len(model.decoder_layers) * model.cfg.kv_heads * model.cfg.head_dim * BLOCK_LEN * 4
    tight = EngineCore(model, None, n_slots=9, max_len=64, max_src_len=16, kv_cache_bytes=(1 + 8) * per_block)
    got, errors = drain(tight, reqs())
    assert not errors and got == expected
    assert tight.scheduler.preemptions > 0  # beam searches started again, unseen


def test_a_sliding_window_model_gives_blocks_behind_the_window_back():
    """Every layer windowed (Mistral-style): a sequence far past its window holds only the
    blocks the window covers, and decodes exactly as with every block kept."""
    model = tiny_model("decoder", seed=3, max_positions=512, positional="rope", norm="rmsnorm", mlp="gated",
                       n_heads=4, n_kv_heads=2, activation="silu", sliding_window=20)
    prompt = torch.randint(3, model.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=150, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():  # the reference: full recomputation, window masked by the model
        ids = list(prompt)
        for _ in range(150):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    core = EngineCore(model, None, n_slots=1, max_len=256)
    core.add(EngineRequest("w", prompt, params))
    held, tokens = [], []
    while core.has_work:
        tokens += [t for e in core.step().events for t in e.token_ids]
        held.append(core.cache.pool.used)
    assert tokens == ids[30:]
    assert max(held[-50:]) <= -(-20 // BLOCK_LEN) + 2  # the window's blocks and the one being written


def test_a_bfloat16_cache_gives_the_same_logits_whole_in_chunks_or_from_the_prefix_cache(llama):
    """A prompt computed whole attends over its K/V as the cache holds them (rounded to
    bfloat16), as a chunked prompt or one continuing a cached prefix does: the same logits to
    float32 rounding, not bfloat16's (greedy outputs then do not depend on the prefix cache)."""
    ids = torch.randint(3, llama.cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.inference_mode():
        whole = llama.prefill(llama.new_cache(1, 128, dtype=torch.bfloat16), [ids], [0])[0]
        cache = llama.new_cache(1, 128, dtype=torch.bfloat16)
        llama.prefill(cache, [ids[:32]], [0])
        chunked = llama.prefill(cache, [ids[32:]], [0], starts=[32])[0]
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)  # without the rounding: 5e-5 apart
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    core = EngineCore(llama, None, n_slots=2, max_len=256, prefix_cache=True, step=_bf16_step(llama))
    cold, _ = drain(core, [EngineRequest("cold", ids, greedy)])
    hit, _ = drain(core, [EngineRequest("hit", ids, greedy)])
    assert core.prefix.hit_tokens == 4 * BLOCK_LEN and hit["hit"] == cold["cold"]


def _bf16_step(model):
    from model.decode import PythonStep

    step = PythonStep(model)
    step.kv_dtype = torch.bfloat16
    return step


def test_a_copy_on_write_into_a_block_never_used_before_keeps_the_copy(llama):
    """The runner zeroes newly allocated blocks before it copies into them, not after."""
    from model.engine.plan import StepPlan

    core = EngineCore(llama, None, n_slots=2, max_len=64)
    cache = core.cache
    with torch.inference_mode():
        llama.prefill(cache, [list(range(3, 23))], [0])  # row 0: 20 positions in two blocks
    cache.fork([0], [1])  # row 1 shares them
    shared, own = cache.private(1, 19)  # the partial block, about to be written by row 1: copied
    assert own in cache.pool.fresh and cache.pool.refs[shared] == 1
    core.runner.run(StepPlan(copies=[(shared, own)]))
    cache.batch([1])  # what the next forward pass over row 1 does first
    assert torch.equal(cache.k[:, :, own, :4], cache.k[:, :, shared, :4]) and cache.k[:, :, own, :4].abs().sum() > 0


def test_a_byte_budget_is_raised_to_one_full_context_never_past_every_row(llama):
    """The pool holds kv_cache_min_tokens (the service asks for one sequence at the model's
    context) whatever the byte budget says, in blocks of the model's own size; a larger budget
    is kept, up to every row at max_len."""
    per = block_bytes(llama)
    assert per == EngineCore.block_bytes(llama, torch.float32)
    small = EngineCore(llama, None, n_slots=4, max_len=256, kv_cache_bytes=(1 + 2) * per, kv_cache_min_tokens=256)
    assert small.scheduler.capacity_tokens() == 256  # 16 blocks, where the bytes alone held 2
    assert small.cache.n_blocks - 1 == 256 // BLOCK_LEN
    roomy = EngineCore(llama, None, n_slots=4, max_len=256, kv_cache_bytes=(1 + 40) * per, kv_cache_min_tokens=256)
    assert roomy.scheduler.capacity_tokens() == 40 * BLOCK_LEN
    capped = EngineCore(llama, None, n_slots=4, max_len=256, kv_cache_bytes=(1 + 99) * per, kv_cache_min_tokens=256)
    assert capped.scheduler.capacity_tokens() == 4 * 256
    long = EngineRequest("long", [3 + i % 50 for i in range(197)], SamplingParams(max_new_tokens=50, temperature=0.0,
                                                                     ignore_eos=True))
    tokens, errors = drain(small, [long])
    assert not errors and len(tokens["long"]) == 50  # 247 tokens: a whole context fits the raised pool
