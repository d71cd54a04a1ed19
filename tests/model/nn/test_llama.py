"""The Llama-architecture decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) against
transformers' LlamaForCausalLM on the same random weights, and through our KV cache."""

from __future__ import annotations

import pytest
import torch

from model import SamplingParams, build_model, generate
from model.nn.layers import Linear, rope_inv_freq
from tests.conftest import tiny_config

transformers = pytest.importorskip("transformers")

SCALINGS = {
    "none": None,
    "linear": {"type": "linear", "factor": 2.0},
    "llama3": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


def llama_config(**overrides):
    base = dict(d_model=48, n_heads=6, n_kv_heads=2, d_ff=96, positional="rope", rope_theta=500.0, norm="rmsnorm",
                mlp="gated", activation="silu", norm_placement="pre", final_norm=True, bias=False,
                tie_word_embeddings=True, max_positions=64)
    base.update(overrides)
    return tiny_config("decoder", **base)


def hf_twin(cfg, ours):
    """A transformers LlamaForCausalLM with our weights."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    if scaling:
        scaling["rope_type"] = scaling.pop("type")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_decoder_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_positions, rms_norm_eps=cfg.layer_norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling=scaling, tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False,
        pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    sd = {"model.embed_tokens.weight": ours.embed.tokens.weight, "model.norm.weight": ours.decoder_norm.weight}
    for i, layer in enumerate(ours.decoder_layers):
        q, k, v = layer.self_attn.qkv_proj.weight.split([q_out, kv_out, kv_out])
        p = f"model.layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                   p + "self_attn.o_proj.weight": layer.self_attn.out_proj.weight,
                   p + "mlp.gate_proj.weight": layer.ffn.gate.weight, p + "mlp.up_proj.weight": layer.ffn.up.weight,
                   p + "mlp.down_proj.weight": layer.ffn.down.weight,
                   p + "input_layernorm.weight": layer.self_attn_norm.weight,
                   p + "post_attention_layernorm.weight": layer.ffn_norm.weight})
    sd["lm_head.weight"] = ours.lm_head.proj.weight
    hf.load_state_dict(sd, strict=True)
    return hf


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers_llama(scaling, tied, fresh_seed):
    cfg = llama_config(rope_scaling=SCALINGS[scaling], tie_word_embeddings=tied)
    ours = build_model(cfg).init_weights(fresh_seed).eval()
    hf = hf_twin(cfg, ours)
    g = torch.Generator().manual_seed(fresh_seed)
    ids = torch.randint(3, cfg.vocab_size, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    mask[2, :30] = 0
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, mask)
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max() < 1e-4


def test_llama3_scaling_changes_only_low_frequencies():
    plain = rope_inv_freq(llama_config())
    # wavelengths: 2*pi (fastest) < 64/4 are kept; 2*pi*500**0.75 (slowest) > 64/1 are divided
    scaled = rope_inv_freq(llama_config(rope_scaling={**SCALINGS["llama3"], "original_max_position_embeddings": 64}))
    assert torch.equal(scaled[0], plain[0])  # the fastest rotation is kept
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)  # the slowest is divided by the factor


def test_cache_holds_kv_heads_only_and_cached_decoding_equals_recomputation(fresh_seed):
    cfg = llama_config()
    model = build_model(cfg).init_weights(fresh_seed).eval()
    cache = model.new_cache(2, 32)
    assert cache.k.shape == (cfg.n_decoder_layers, cfg.kv_heads, 1 + 2 * 2, 16, cfg.head_dim)  # 2 rows x 32 positions
    g = torch.Generator().manual_seed(fresh_seed)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 11)]
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    batched = generate(model, prompts, params)
    for prompt, res in zip(prompts, batched):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(20):  # greedy by full recomputation, no cache
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert res.token_ids == seq[len(prompt):]
        assert generate(model, [prompt], params)[0].token_ids == res.token_ids  # alone == batched


def test_engine_features_on_llama_chunked_prefill_int8_bf16(fresh_seed):
    """Continuous batching with chunked prefill gives what each request gets alone; int8 and
    bfloat16 weights run through the same engine and stay close to float32."""
    from model.engine import EngineCore, EngineRequest
    from model.quant.int8 import quantize_int8_

    cfg = llama_config(max_positions=128)
    model = build_model(cfg).init_weights(fresh_seed).eval()
    g = torch.Generator().manual_seed(fresh_seed)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (30, 3, 17)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    core = EngineCore(model, None, n_slots=2, max_len=64, max_prefill_tokens=7)  # 30 tokens: 5 chunks
    for i, p in enumerate(prompts):
        core.add(EngineRequest(str(i), p, params))
    out: dict[str, list[int]] = {}
    while core.has_work:
        for e in core.step().events:
            out.setdefault(e.request_id, []).extend(e.token_ids)
    alone = [generate(model, [p], params)[0].token_ids for p in prompts]
    assert [out[str(i)] for i in range(3)] == alone

    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        ref = model(ids).float()
        half = build_model(cfg).to(torch.bfloat16)
        half.load_state_dict(model.state_dict())
        assert (half.eval()(ids).float() - ref).abs().max() < 0.1 * ref.abs().max()
        quantize_int8_(model)
        assert (model(ids).float() - ref).abs().max() < 0.1 * ref.abs().max()
    # SwiGLU's output projection stays in float (activation outliers); the others are int8
    ffn = model.decoder_layers[0].ffn
    assert isinstance(ffn.down, Linear) and not isinstance(ffn.up, Linear)
    assert len(generate(model, [prompts[1]], params)[0].token_ids) == 8
