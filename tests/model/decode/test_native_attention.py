"""The native library's decode attention for the Python step on the CPU (model/decode/native.py:
``NativeDecodeAttention``; csrc: ``paged_decode_attention``, ``cross_decode_attention``): each row
attends over its positions read where they lie in the block pool (self-attention) or in its
source's encoder memory (cross-attention), against SDPA over gathered copies, and the
encoder-decoder's generations through it against the SDPA step's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import SamplingParams, beam_search, generate
from model.decode import DecodeOptions, prepare
from model.decode.native import NativeDecodeAttention
from model.decode.triton_attention import decode_attention_reference
from tests.conftest import tiny_model
from tests.model.decode_steps import native_library_or_skip


@pytest.fixture(scope="module")
def kernel() -> NativeDecodeAttention:
    native_library_or_skip()
    return NativeDecodeAttention()


def _pool(g: torch.Generator, nkv: int, blocks: int, block_len: int, hs: int, dtype: torch.dtype):
    k = torch.randn(nkv, blocks, block_len, hs, generator=g).to(dtype)
    v = torch.randn(nkv, blocks, block_len, hs, generator=g).to(dtype)
    return k, v


# head size 64 and 256 take the AVX-512 loops where the CPU has them, 48 and 8 the portable ones
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hs", "nh", "nkv"), [(64, 8, 8), (64, 9, 3), (256, 4, 1), (48, 6, 2), (8, 4, 4)])
@pytest.mark.parametrize("window", [0, 20])
def test_paged_attention_equals_sdpa_over_the_gathered_blocks(kernel, fresh_seed, dtype, hs, nh, nkv, window):
    g = torch.Generator().manual_seed(fresh_seed)
    block_len, blocks = 16, 48
    k_pool, v_pool = _pool(g, nkv, blocks, block_len, hs, dtype)
    lengths = torch.tensor([1, 16, 17, 50, 96, 33])
    tables = torch.stack([torch.randperm(blocks, generator=g)[:6] for _ in lengths])  # scattered blocks
    q = torch.randn(len(lengths), nh, hs, generator=g)
    scale = hs ** -0.5
    # the kernel's calling convention: (blocks, nkv, block_len, hs) views of the layer's pool
    got = kernel(q, k_pool.transpose(0, 1), v_pool.transpose(0, 1), tables, lengths, scale, window)
    want = decode_attention_reference(q, k_pool.transpose(0, 1), v_pool.transpose(0, 1), tables, lengths, scale, window)
    assert got.shape == (len(lengths), nh, hs)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hs", [64, 8])
def test_cross_attention_equals_sdpa_over_each_source(kernel, fresh_seed, dtype, hs):
    g = torch.Generator().manual_seed(fresh_seed)
    n_slots, nh, max_src = 7, 4, 40
    k_mem = torch.randn(n_slots, nh, max_src, hs, generator=g).to(dtype)
    v_mem = torch.randn(n_slots, nh, max_src, hs, generator=g).to(dtype)
    slots = torch.tensor([5, 0, 3, 6])
    lengths = torch.tensor([40, 1, 23, 7])
    q = torch.randn(len(slots), nh, hs, generator=g)
    got = kernel.cross(q, k_mem, v_mem, slots, lengths, hs ** -0.5)
    for b, (slot, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        want = F.scaled_dot_product_attention(q[b, :, None], k_mem[slot, :, :n].float(), v_mem[slot, :, :n].float(),
                                              scale=hs ** -0.5)[:, 0]
        torch.testing.assert_close(got[b], want, atol=2e-6, rtol=1e-5)


def test_kernels_refuse_what_they_cannot_read(kernel):
    k_pool, v_pool = torch.zeros(2, 4, 16, 64), torch.zeros(2, 4, 16, 64)
    q, tables = torch.zeros(1, 4, 64), torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="attends to 33 positions; its table holds 32"):
        kernel(q, k_pool.transpose(0, 1), v_pool.transpose(0, 1), tables, torch.tensor([33]), 0.125)
    with pytest.raises(RuntimeError, match="block 9 out of range"):
        kernel(q, k_pool.transpose(0, 1), v_pool.transpose(0, 1), torch.tensor([[0, 9]]), torch.tensor([20]), 0.125)
    with pytest.raises(RuntimeError, match="multiple of the pool's K/V heads"):
        kernel(torch.zeros(1, 3, 64), k_pool.transpose(0, 1), v_pool.transpose(0, 1), tables, torch.tensor([4]), 0.1)
    mem = torch.zeros(3, 4, 10, 64)
    with pytest.raises(RuntimeError, match="slot 3 out of range"):
        kernel.cross(q, mem, mem, torch.tensor([3]), torch.tensor([5]), 0.125)
    with pytest.raises(RuntimeError, match="has 11 source tokens; the memory holds 10"):
        kernel.cross(q, mem, mem, torch.tensor([1]), torch.tensor([11]), 0.125)


def _translator():
    # head size 64: the AVX-512 loops where the CPU has them (the shipped translator's size)
    return tiny_model("encoder-decoder", seed=5, d_model=128, n_heads=2, d_ff=128, max_positions=64)


def _sources(model, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist() + [model.cfg.eos_token_id]
            for n in lengths]


def test_prepare_gives_the_python_step_the_kernel_on_the_cpu(kernel):
    model = _translator()  # float32 (an int8 translator gets the native encoder-decoder step)
    assert isinstance(prepare(model, DecodeOptions(quantize="none")).attention, NativeDecodeAttention)
    assert isinstance(prepare(model, DecodeOptions(quantize="none", attention="native")).attention,
                      NativeDecodeAttention)
    assert prepare(model, DecodeOptions(quantize="none", attention="sdpa")).attention is None
    decoder = tiny_model("decoder", seed=3)  # a model the native step does not take keeps the Python step
    assert isinstance(prepare(decoder, DecodeOptions(native="off")).attention, NativeDecodeAttention)


def test_translations_through_the_kernel_equal_the_sdpa_steps(kernel, fresh_seed):
    """Sources of ragged lengths decoded together (rows at different source lengths in one
    step, every layer's self- and cross-attention through the kernel): the same greedy tokens
    and per-token log-probabilities within float rounding of SDPA's."""
    model = _translator()
    sources = _sources(model, fresh_seed, (3, 17, 9, 30, 1))
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    sdpa = generate(model, sources, params, step=prepare(model, DecodeOptions(quantize="none", attention="sdpa")))
    ours = generate(model, sources, params, step=prepare(model, DecodeOptions(quantize="none", attention="native")))
    assert [r.token_ids for r in ours] == [r.token_ids for r in sdpa]
    for a, b in zip(ours, sdpa):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_translations_through_the_kernel_are_batch_invariant(kernel, fresh_seed):
    model = _translator()
    step = prepare(model, DecodeOptions(quantize="none", attention="native"))
    sources = _sources(model, fresh_seed + 1, (12, 4, 25, 7))
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    together = [r.token_ids for r in generate(model, sources, params, step=step)]
    alone = [generate(model, [s], params, step=step)[0].token_ids for s in sources]
    assert together == alone
    beams = beam_search(model, sources, beam_size=3, max_new_tokens=10, step=step)
    sdpa_beams = beam_search(model, sources, beam_size=3, max_new_tokens=10,
                             step=prepare(model, DecodeOptions(quantize="none", attention="sdpa")))
    for a, b in zip(beams, sdpa_beams):  # beam forks share blocks: tables change under the kernel every step
        assert a.token_ids == b.token_ids
        assert a.score == pytest.approx(b.score, abs=1e-4)
