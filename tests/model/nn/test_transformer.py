"""Models: cached decoding equals recomputation; batches equal single sequences."""

from __future__ import annotations

import pytest
import torch

from model import SamplingParams, build_model, generate
from model.nn.layers import AttentionContext, MultiHeadAttention
from tests.conftest import tiny_config, tiny_model

TOL = 1e-5
DECODER_VARIANTS = {
    "gpt2-like": {},
    "paper-like": dict(norm_placement="post", final_norm=False, positional="sinusoidal", scale_embedding=True,
                       activation="relu", fused_qkv=False),
}


def rand_ids(g, n, vocab=61):
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("variant", DECODER_VARIANTS)
@torch.inference_mode()
def test_decoder_cached_steps_equal_recomputation(variant):
    model = tiny_model("decoder", seed=4, **DECODER_VARIANTS[variant])
    g = torch.Generator().manual_seed(0)
    seqs = [rand_ids(g, 20) for _ in range(3)]
    full = [model(torch.tensor([s]))[0] for s in seqs]  # (T, V) each, no cache
    cache = model.new_cache(n_slots=5, max_len=32)
    slots, prompt_lens = [4, 0, 2], [3, 9, 6]  # non-contiguous slots, different positions
    logits = model.prefill(cache, [s[:n] for s, n in zip(seqs, prompt_lens)], slots)
    for row, n in enumerate(prompt_lens):
        assert (logits[row] - full[row][n - 1]).abs().max() < TOL
    pos = list(prompt_lens)
    for _ in range(8):
        tokens = torch.tensor([seqs[r][pos[r]] for r in range(3)])
        logits = model.decode_step(cache, tokens, slots, pos)
        for r in range(3):
            assert (logits[r] - full[r][pos[r]]).abs().max() < TOL
        pos = [p + 1 for p in pos]


@torch.inference_mode()
def test_freed_slot_is_reused_without_stale_history(decoder_lm):
    model = decoder_lm
    g = torch.Generator().manual_seed(1)
    old, new, other = rand_ids(g, 15), rand_ids(g, 4), rand_ids(g, 7)
    cache = model.new_cache(n_slots=2, max_len=32)
    ptr = cache.k.data_ptr()
    model.prefill(cache, [old, other], [0, 1])  # slot 0 holds a long sequence, then is freed
    logits = model.prefill(cache, [new], [0])  # reuse slot 0 for a shorter one
    full = model(torch.tensor([new + other]))[0]
    assert (logits[0] - full[len(new) - 1]).abs().max() < TOL
    # decode both: the reused slot and the untouched one, at different positions
    step = model.decode_step(cache, torch.tensor([other[0], other[0]]), [0, 1], [len(new), len(other)])
    ref_new = model(torch.tensor([new + [other[0]]]))[0, -1]
    ref_other = model(torch.tensor([other + [other[0]]]))[0, -1]
    assert (step[0] - ref_new).abs().max() < TOL and (step[1] - ref_other).abs().max() < TOL
    assert cache.k.data_ptr() == ptr  # written in place, never reallocated


@torch.inference_mode()
def test_chunked_prefill_equals_one_shot(decoder_lm):
    g = torch.Generator().manual_seed(2)
    seq = rand_ids(g, 17)
    cache = decoder_lm.new_cache(n_slots=1, max_len=32)
    decoder_lm.prefill(cache, [seq[:6]], [0])
    logits = decoder_lm.prefill(cache, [seq[6:]], [0], starts=[6])
    assert (logits[0] - decoder_lm(torch.tensor([seq]))[0, -1]).abs().max() < TOL


@torch.inference_mode()
def test_encoder_decoder_cached_steps_equal_recomputation(encoder_decoder):
    model = encoder_decoder
    g = torch.Generator().manual_seed(3)
    srcs = [rand_ids(g, n) for n in (5, 11, 8)]
    tgts = [[model.cfg.decoder_start_token_id] + rand_ids(g, 9) for _ in srcs]
    cache = model.new_cache(n_slots=4, max_len=16, max_src_len=12)
    slots = [3, 1, 2]
    logits = model.prefill(cache, srcs, slots)
    full = [model(torch.tensor([s]), torch.tensor([t]))[0] for s, t in zip(srcs, tgts)]
    for r in range(3):
        assert (logits[r] - full[r][0]).abs().max() < TOL
    for p in range(1, 10):
        logits = model.decode_step(cache, torch.tensor([t[p] for t in tgts]), slots, [p] * 3)
        for r in range(3):
            assert (logits[r] - full[r][p]).abs().max() < TOL
    # padded batch through forward() equals the unpadded rows
    src = torch.zeros(3, 11, dtype=torch.long)
    for r, s in enumerate(srcs):
        src[r, : len(s)] = torch.tensor(s)
    batched = model(src, torch.tensor(tgts), src_mask=src != 0)
    for r in range(3):
        assert (batched[r] - full[r]).abs().max() < TOL


@torch.inference_mode()
def test_encoder_decoder_slot_reuse_with_a_shorter_source(encoder_decoder):
    model = encoder_decoder
    g = torch.Generator().manual_seed(4)
    long_src, short_src = rand_ids(g, 12), rand_ids(g, 3)
    cache = model.new_cache(n_slots=1, max_len=8, max_src_len=12)
    model.prefill(cache, [long_src], [0])
    logits = model.prefill(cache, [short_src], [0])
    start = torch.tensor([[model.cfg.decoder_start_token_id]])
    assert (logits[0] - model(torch.tensor([short_src]), start)[0, 0]).abs().max() < TOL


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
def test_greedy_is_batch_invariant(family, decoder_lm, encoder_decoder):
    model = decoder_lm if family == "decoder" else encoder_decoder
    g = torch.Generator().manual_seed(5)
    prompts = [rand_ids(g, n) for n in (6, 2, 13, 9)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    batched = generate(model, prompts, params)
    for p, b in zip(prompts, batched):
        assert generate(model, [p], params)[0].token_ids == b.token_ids


@torch.inference_mode()
def test_decoder_left_padding_mask(decoder_lm):
    g = torch.Generator().manual_seed(6)
    seq = rand_ids(g, 7)
    ids = torch.tensor([[0, 0, 0] + seq])
    mask = torch.tensor([[False] * 3 + [True] * 7])
    padded = decoder_lm(ids, attention_mask=mask)[0, 3:]
    assert (padded - decoder_lm(torch.tensor([seq]))[0]).abs().max() < TOL


@torch.inference_mode()
def test_masked_lm_padding_and_pooling(masked_lm):
    g = torch.Generator().manual_seed(7)
    a, b = rand_ids(g, 9), rand_ids(g, 5)
    ids = torch.tensor([a, b + [0] * 4])
    mask = ids != 0
    mask[0] = True
    hidden = masked_lm.hidden_states(ids, mask)
    alone = masked_lm.hidden_states(torch.tensor([b]))
    assert (hidden[1, :5] - alone[0]).abs().max() < TOL
    pooled = masked_lm.pool(hidden, mask)
    assert (pooled[1] - alone[0].mean(0)).abs().max() < TOL
    logits = masked_lm(ids, mask)
    assert logits.shape == (2, 9, masked_lm.cfg.vocab_size)


def test_fused_and_separate_qkv_compute_the_same(fresh_seed):
    torch.manual_seed(fresh_seed)
    sep = MultiHeadAttention(tiny_config("decoder", fused_qkv=False))
    fused = MultiHeadAttention(tiny_config("decoder", fused_qkv=True))
    with torch.no_grad():
        fused.qkv_proj.weight.copy_(torch.cat([sep.q_proj.weight, sep.k_proj.weight, sep.v_proj.weight]))
        fused.qkv_proj.bias.copy_(torch.cat([sep.q_proj.bias, sep.k_proj.bias, sep.v_proj.bias]))
        fused.out_proj.load_state_dict(sep.out_proj.state_dict())
    x = torch.randn(2, 5, 32)
    ctx = AttentionContext(causal=True)
    assert (sep.self_attention(x, ctx) - fused.self_attention(x, ctx)).abs().max() < 1e-6


def test_tied_embeddings_share_storage():
    model = build_model(tiny_config("decoder"))
    assert model.lm_head.proj.weight is model.embed.tokens.weight
    untied = build_model(tiny_config("decoder", tie_word_embeddings=False))
    assert untied.lm_head.proj.weight is not untied.embed.tokens.weight


@torch.inference_mode()
def test_cache_limits_are_enforced(decoder_lm):
    cache = decoder_lm.new_cache(n_slots=2, max_len=8)
    with pytest.raises(ValueError, match="max_len"):
        decoder_lm.prefill(cache, [list(range(3, 12))], [0])
    with pytest.raises(IndexError, match="out of range"):
        decoder_lm.prefill(cache, [[5]], [2])
    with pytest.raises(ValueError, match="max_positions"):
        decoder_lm.new_cache(n_slots=1, max_len=65)


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder", "encoder"])
@torch.inference_mode()
def test_packed_inference_weights_match_float64(family):
    model = tiny_model(family, seed=21)
    ids = torch.randint(3, 61, (3, 9))
    run = (lambda m: m(ids, ids[:, :5])) if family == "encoder-decoder" else (lambda m: m(ids))
    reference = run(tiny_model(family, seed=21).double())
    assert model.optimize_for_inference() > 0
    assert (run(model).double() - reference).abs().max() < 1e-5


@torch.inference_mode()
def test_packed_cached_decoding_equals_recomputation():
    model = tiny_model("decoder", seed=22)
    model.optimize_for_inference()
    g = torch.Generator().manual_seed(9)
    seq = rand_ids(g, 16)
    full = model(torch.tensor([seq]))[0]
    cache = model.new_cache(n_slots=2, max_len=32)
    logits = model.prefill(cache, [seq[:5]], [1])
    assert (logits[0] - full[4]).abs().max() < TOL
    for p in range(5, 15):
        logits = model.decode_step(cache, torch.tensor([seq[p]]), [1], [p])
        assert (logits[0] - full[p]).abs().max() < TOL


def test_training_drops_packed_weights():
    model = tiny_model("decoder", seed=23)
    model.optimize_for_inference()
    model.train()
    assert all(m.packed is None for m in model.modules() if hasattr(m, "packed"))
    ids = torch.randint(3, 61, (2, 6))
    model(ids).sum().backward()  # gradients flow through the plain weights
    assert model.decoder_layers[0].ffn.up.weight.grad is not None


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
def test_moved_slot_decodes_exactly_as_before(family, decoder_lm, encoder_decoder):
    """move_table and move_cross carry the whole state (the block table of the self-attention
    history, cross-attention memory and source length) to another row: the next step's logits
    are identical there."""
    model = decoder_lm if family == "decoder" else encoder_decoder
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (9, 5)]
    cache = model.new_cache(4, 32, max_src_len=16 if family == "encoder-decoder" else 0)
    model.prefill(cache, prompts, [0, 3])  # slot 3 holds the second sequence; 1 and 2 hold nothing yet
    # next positions of slots 0 and 3 (the encoder-decoder's decoder starts after its start token)
    pos0, pos = (1, 1) if family == "encoder-decoder" else (len(prompts[0]), len(prompts[1]))
    for step in range(3):  # some decoded history too
        model.decode_step(cache, torch.tensor([11 + step, 12 + step]), [0, 3], [pos0, pos])
        pos0, pos = pos0 + 1, pos + 1
    expected = model.decode_step(cache, torch.tensor([13]), [3], [pos])
    model.prefill(cache, [[5, 6, 7]], [1])  # slot 1 held something else, released
    cache.release(1)
    cache.move_table(3, 1)
    cache.move_cross(3, 1)
    assert cache.rows[3] == [] and cache.rows[1]
    moved = model.decode_step(cache, torch.tensor([13]), [1], [pos])
    torch.testing.assert_close(moved, expected, rtol=0, atol=1e-6)


def test_beam_rows_read_their_sources_memory_once_wherever_rows_move(encoder_decoder):
    """A source's cross-attention memory is written once, in its first row, and every beam row
    reads it there (``cross_rows``): the rows decode exactly as rows holding their own copy do,
    and go on doing so after moves of the row holding the memory and of a row reading it."""
    model = encoder_decoder
    g = torch.Generator().manual_seed(11)
    sources = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (9, 5)]
    shared = model.new_cache(8, 32, max_src_len=16)
    model.prefill(shared, sources, [0, 1, 2, 4, 5], group_sizes=[3, 2])
    assert [shared.cross_rows_host[s] for s in (0, 1, 2, 4, 5)] == [0, 0, 0, 4, 4]
    own = model.new_cache(8, 32, max_src_len=16)  # each row its own copy: one source per row
    model.prefill(own, [sources[0]] * 3 + [sources[1]] * 2, [0, 1, 2, 4, 5])
    tokens = torch.tensor([11, 12, 13, 14, 15])
    expected = model.decode_step(own, tokens, [0, 1, 2, 4, 5], [1] * 5)
    torch.testing.assert_close(model.decode_step(shared, tokens, [0, 1, 2, 4, 5], [1] * 5), expected, rtol=0, atol=0)
    for src, dst in ((0, 6), (5, 3)):  # the row holding the first source's memory, then a row reading another's
        shared.move_table(src, dst)
        shared.move_cross(src, dst)
    assert [shared.cross_rows_host[s] for s in (6, 1, 2, 4, 3)] == [6, 6, 6, 4, 4]
    model.prefill(shared, [[5, 6, 7], [8, 9]], [0, 5])  # the rows left behind hold other sources now
    follow = torch.tensor([21, 22, 23, 24, 25])
    after = model.decode_step(shared, follow, [6, 1, 2, 4, 3], [2] * 5)
    torch.testing.assert_close(after, model.decode_step(own, follow, [0, 1, 2, 4, 5], [2] * 5), rtol=0, atol=0)
