"""The prefix cache: prompts that share leading blocks compute them once and read them in
place (the very blocks, no copy), and every request gets exactly what it gets without the
cache (chunked prefill on, arrivals together and one after another, eviction from a tiny
pool), on the shipped GPT-style decoder and on a tiny Llama-style one (rope, grouped-query
attention)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import SamplingParams, load_model
from model.engine import EngineCore, EngineRequest
from model.engine.block_pool import BlockPool
from model.engine.prefix_cache import block_hashes
from model.nn.kv_cache import BLOCK_LEN
from tests.conftest import tiny_model

B = BLOCK_LEN
GENERATE_EN = Path(__file__).resolve().parents[3] / "weights" / "generate-en"


@pytest.fixture(scope="module")
def gpt():
    return load_model(GENERATE_EN).model.eval()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("decoder", seed=5, max_positions=256, positional="rope", norm="rmsnorm", mlp="gated",
                      n_heads=4, n_kv_heads=2, activation="silu")


def shared_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """A 100-token common prefix with short different tails, the prefix alone at exactly two
    blocks, a prompt shorter than a block, and one that shares only the first block."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    common = rand(100)
    return [common + rand(3), common + rand(9), common + rand(1), common[:2 * B], common[:B - 4],
            common[:B] + rand(40), common + rand(30)]


def params(seed: int | None = None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    return SamplingParams(max_new_tokens=4, temperature=1.0, seed=seed, ignore_eos=True)


def run(core: EngineCore, prompts: list[list[int]], arrive_every: int, seeded: bool = False):
    """Add request i before step ``i * arrive_every`` (0: all at once); step until done.
    Returns each request's tokens and logprobs, and the hit tokens each admission reported."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    hits: dict[str, int] = {}
    step = 0
    while step < 1000:
        for i, p in enumerate(prompts):
            if i * arrive_every == step:
                core.add(EngineRequest(str(i), p, params(i if seeded else None)))
        if not core.has_work and step >= (len(prompts) - 1) * arrive_every:
            break
        result = core.step()
        for seq in core.scheduler.prefilling + core.scheduler.running:
            hits.setdefault(seq.req.request_id, seq.cached_tokens)
        for event in result.events:
            assert event.error is None
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            logprobs.setdefault(event.request_id, []).extend(event.logprobs)
        step += 1
    order = [str(i) for i in range(len(prompts))]
    return [tokens[k] for k in order], [logprobs.get(k, []) for k in order], [hits.get(k, 0) for k in order]


def compare(model, prompts, arrive_every: int, seeded: bool = False, **kw):
    plain = run(EngineCore(model, None, n_slots=4, max_len=200, max_prefill_tokens=64), prompts, arrive_every, seeded)
    core = EngineCore(model, None, n_slots=4, max_len=200, max_prefill_tokens=64, prefix_cache=True, **kw)
    cached = run(core, prompts, arrive_every, seeded)
    assert cached[0] == plain[0]
    for a, b in zip(cached[1], plain[1]):
        assert a == pytest.approx(b, abs=1e-4)
    return core, cached[2]


@pytest.mark.parametrize("arrive_every", [0, 3])  # all together; one after another
@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_outputs_identical_with_and_without_the_prefix_cache(which, arrive_every, request):
    model = request.getfixturevalue(which)
    prompts = shared_prompts(model.cfg.vocab_size)
    core, hits = compare(model, prompts, arrive_every)
    assert sum(hits) > 0 and hits[0] == 0  # the first computes the prefix, later ones reuse it
    assert hits[4] == 0  # shorter than a block: nothing to match
    assert hits[3] == B  # exactly two blocks: the last token (of block two) is computed
    assert hits[5] == B  # shares only its first block
    info = core.prefix_cache_info()
    assert info["hit_tokens"] == sum(hits) and info["query_tokens"] == sum(map(len, prompts))


def test_seeded_sampling_identical_with_the_prefix_cache(llama):
    compare(llama, shared_prompts(llama.cfg.vocab_size, seed=3), 2, seeded=True)


def test_eviction_from_a_small_pool_keeps_outputs_identical(llama):
    """A pool of 13 blocks (two 6-block prompts and their growth): the cached blocks of earlier
    prompts are evicted to make room, and requests wait for blocks."""
    per_block = 2 * len(llama.decoder_layers) * llama.cfg.kv_heads * llama.cfg.head_dim * B * 4
    g = torch.Generator().manual_seed(7)
    families = [torch.randint(3, 61, (80,), generator=g).tolist() for _ in range(3)]
    prompts = [f + torch.randint(3, 61, (k,), generator=g).tolist() for k in (2, 5) for f in families]
    core, hits = compare(llama, prompts, 2, kv_cache_bytes=(1 + 13) * per_block)
    pool = core.cache.pool
    assert pool.n_blocks == 1 + 13 and pool.evictions > 0 and sum(hits) > 0


def test_a_hit_reads_the_very_blocks_of_the_first_request(llama):
    """No copy: the second request's block table starts with the first one's blocks."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, 61, (3 * B + 5,), generator=g).tolist()
    core = EngineCore(llama, None, n_slots=2, max_len=200, prefix_cache=True)
    core.add(EngineRequest("a", system + [7], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)))
    core.step()
    first = list(core.cache.rows[0][:3])
    core.add(EngineRequest("b", system + [9], params()))
    core.step()
    (b,) = [s for s in core.scheduler.prefilling + core.scheduler.running if s.req.request_id == "b"]
    assert core.cache.rows[b.slots[0]][:3] == first and b.cached_tokens == 3 * B
    assert all(core.cache.pool.refs[block] == 2 for block in first)


def test_second_request_hits_every_full_block_before_its_last_token(llama):
    g = torch.Generator().manual_seed(1)
    for n in (B - 1, B, B + 1, 2 * B, 3 * B + 5, 150):
        prompt = torch.randint(3, 61, (n,), generator=g).tolist()
        core = EngineCore(llama, None, n_slots=2, max_len=200, prefix_cache=True)
        _, _, first = run(core, [prompt], 0)
        _, _, second = run(core, [prompt], 0)
        assert first == [0] and second == [(n - 1) // B * B], n
        assert core.prefix.hit_tokens == (n - 1) // B * B and core.prefix.query_tokens == 2 * n


def test_a_burst_sharing_a_prefix_computes_it_once(llama):
    g = torch.Generator().manual_seed(2)
    system = torch.randint(3, 61, (3 * B + 10,), generator=g).tolist()
    prompts = [system + torch.randint(3, 61, (4,), generator=g).tolist() for _ in range(4)]
    core = EngineCore(llama, None, n_slots=4, max_len=200, max_prefill_tokens=512, prefix_cache=True)
    written = 0
    for i, p in enumerate(prompts):
        core.add(EngineRequest(str(i), p, params()))
    while core.has_work:
        written += core.step().prompt_tokens
    assert core.prefix.hit_tokens == 3 * 3 * B  # the three that waited one step reuse three blocks each
    assert written == sum(map(len, prompts)) - 3 * 3 * B


def test_encoder_decoder_has_no_prefix_cache():
    core = EngineCore(tiny_model("encoder-decoder", seed=2), None, n_slots=2, max_len=32, max_src_len=32,
                      prefix_cache=True)
    assert core.prefix is None and core.prefix_cache_info() is None


def test_block_hashes_chain_over_the_whole_prefix():
    a, b = list(range(2 * B)), list(range(1, B + 1)) + list(range(B, 2 * B))
    ha, hb = block_hashes(a, B), block_hashes(b, B)
    assert len(ha) == 2 and len(block_hashes(a[:-1], B)) == 1
    assert ha[1] != hb[1]  # the same second block under a different first block
    assert block_hashes(a + [5], B) == ha


def test_pool_evicts_unreferenced_named_blocks_least_recently_released_first():
    pool = BlockPool(5)  # 4 usable blocks
    chain = [pool.allocate() for _ in range(3)]
    for i, block in enumerate(chain):
        pool.name(bytes([i]), block)
    assert pool.lookup([bytes([0]), bytes([1]), bytes([2])], 3) == chain
    for block in reversed(chain):  # a sequence releases its last block first
        pool.decref(block)
    assert pool.available == 4 and pool.used == 0 and len(pool.evictable) == 3
    pool.incref(chain[0])  # a new request reads the root in place: no longer evictable
    extra = pool.allocate()  # the free block first
    assert extra not in chain and pool.evictions == 0
    assert pool.allocate() == chain[2]  # then the least recently released: the leaf
    assert pool.lookup([bytes([0]), bytes([1]), bytes([2])], 3) == chain[:2]
    assert pool.allocate() == chain[1] and pool.allocate() is None  # the root is referenced
    pool.decref(chain[0])
    pool.forget(chain[0])  # a name whose K/V was never written: dropped, the block freed
    assert pool.lookup([bytes([0])], 1) == [] and pool.allocate() == chain[0]


def test_only_a_prompt_mostly_being_computed_waits_for_it(llama):
    g = torch.Generator().manual_seed(4)
    rand = lambda n: torch.randint(3, 61, (n,), generator=g).tolist()  # noqa: E731
    common = rand(100)
    core = EngineCore(llama, None, n_slots=4, max_len=200, max_prefill_tokens=512, prefix_cache=True)
    core.add(EngineRequest("a", common + rand(2), params()))
    core.add(EngineRequest("b", common[:B] + rand(40), params()))  # one pending block of 72 tokens: go on
    core.add(EngineRequest("c", common[:B] + rand(8), params()))  # one pending block of 40 tokens: wait
    assert [r.request_id for r in core.step().admitted] == ["a", "b"]
    assert [r.request_id for r in core.step().admitted] == ["c"]
    assert {s.req.request_id: s.cached_tokens for s in core.scheduler.running} == {"a": 0, "b": 0, "c": B}
