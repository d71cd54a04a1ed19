"""The layer features of the lineages after Llama, as ModelConfig data (qkv_bias, qk_norm,
head_dim_override, post_sublayer_norm, sliding_window + sliding_window_layers, local_rope_theta,
LongRoPE): the sliding window is real in every path that reads the cache (one prefill, chunked
prefill, decode steps, the prefix cache, batched ragged rows), equal to full recomputation
across the window boundary; and a position outside the window changes nothing."""

from __future__ import annotations

import pytest
import torch

from model import ModelConfig, SamplingParams, build_model, generate
from model.engine import EngineCore, EngineRequest
from tests.model.nn.test_llama import llama_config

WINDOW = 6

CONFIGS = {
    "mistral-like": dict(sliding_window=WINDOW),
    "gemma-like": dict(sliding_window=WINDOW, sliding_window_layers=[0, 2], n_decoder_layers=3, local_rope_theta=50.0,
                       qk_norm=True, post_sublayer_norm=True, head_dim_override=12, scale_embedding=True,
                       activation="gelu_new", attention_scale=0.3),
    "qwen-like": dict(qkv_bias=True, qk_norm=True, head_dim_override=16, tie_word_embeddings=False),
    "phi-longrope": dict(rope_scaling={"type": "longrope", "factors": [1.0, 1.5, 2.0, 4.0], "attention_factor": 1.2}),
}


def _model(name: str, seed: int) -> torch.nn.Module:
    model = build_model(llama_config(**CONFIGS[name])).init_weights(seed).eval()
    with torch.no_grad():  # biases and norms away from their 0 / 1 init, so a mix-up shows
        g = torch.Generator().manual_seed(seed)
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _greedy_by_recomputation(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_decoding_equals_recomputation_across_the_window(name, fresh_seed):
    model = _model(name, fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed)
    prompts = [torch.randint(3, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 11, 40)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    batched = generate(model, prompts, params)  # ragged rows in one prefill, then decode steps
    for prompt, res in zip(prompts, batched):
        assert res.token_ids == _greedy_by_recomputation(model, prompt, 16)
    # chunked prefill (7 tokens a step) and the prefix cache give the same
    core = EngineCore(model, None, n_slots=2, max_len=64, max_prefill_tokens=7, prefix_cache=True)
    shared = prompts[2][:34]  # one 32-token block, copied from the pool for the second request
    later = [prompts[2], shared + prompts[1][:5], prompts[0]]
    out: dict[str, list[int]] = {}
    for i, p in enumerate(later):
        core.add(EngineRequest(str(i), p, params))
        while core.has_work:  # one after the other, so the second finds the first's block
            for e in core.step().events:
                out.setdefault(e.request_id, []).extend(e.token_ids)
    assert core.prefix.hit_tokens == 32
    assert [out[str(i)] for i in range(3)] == [_greedy_by_recomputation(model, p, 16) for p in later]


@pytest.mark.parametrize("name", ["mistral-like", "gemma-like"])
def test_logits_of_cached_steps_equal_full_forward(name, fresh_seed):
    model = _model(name, fresh_seed)
    ids = torch.randint(3, model.cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(fresh_seed))
    with torch.no_grad():
        full = model(ids)[0]  # (T, V)
        cache = model.new_cache(1, 40)
        logits = [model.prefill(cache, [ids[0, :4].tolist()], [0])[0]]
        logits.append(model.prefill(cache, [ids[0, 4:13].tolist()], [0], starts=[4])[0])  # a chunk
        for pos in range(13, 30):
            logits.append(model.decode_step(cache, ids[0, pos:pos + 1], [0], [pos])[0])
    torch.testing.assert_close(torch.stack(logits), full[[3, 12, *range(13, 30)]], atol=1e-5, rtol=0)


def test_a_position_outside_the_window_changes_nothing(fresh_seed):
    """One window layer: the last token sees exactly the WINDOW positions up to itself."""
    model = build_model(llama_config(sliding_window=WINDOW, n_decoder_layers=1)).init_weights(fresh_seed).eval()
    ids = torch.randint(3, model.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(fresh_seed))
    outside, inside = ids.clone(), ids.clone()
    outside[0, 20 - WINDOW - 1] = (ids[0, 20 - WINDOW - 1] + 1) % model.cfg.vocab_size
    inside[0, 20 - WINDOW] = (ids[0, 20 - WINDOW] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        base = model(ids)[0, -1]
        torch.testing.assert_close(model(outside)[0, -1], base, atol=0, rtol=0)
        assert not torch.allclose(model(inside)[0, -1], base)
        cache = model.new_cache(1, 24)
        model.prefill(cache, [outside[0, :19].tolist()], [0])
        torch.testing.assert_close(model.decode_step(cache, ids[0, 19:], [0], [19])[0], base, atol=1e-5, rtol=0)


def test_window_layers_and_local_rope_are_per_layer():
    model = build_model(llama_config(**CONFIGS["gemma-like"]))
    assert [layer.self_attn.window for layer in model.decoder_layers] == [True, False, True]
    assert [layer.self_attn.local_rope for layer in model.decoder_layers] == [True, False, True]
    assert not torch.equal(model.embed.rope, model.embed.rope_local)


@pytest.mark.parametrize("change, needle", [
    (dict(sliding_window_layers=[0]), "needs 'sliding_window'"),
    (dict(sliding_window=4, sliding_window_layers=[5]), "sliding_window_layers"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(post_sublayer_norm=True, norm_placement="post"), "post_sublayer_norm"),
    (dict(rope_scaling={"type": "longrope", "factors": [1.0], "attention_factor": 1.0}), "factors"),
    (dict(head_dim_override=0), "head_dim_override"),
])
def test_invalid_lineage_fields_are_named(change, needle):
    with pytest.raises(ValueError, match=needle):
        llama_config(**change)


def test_round_trip_of_the_new_fields():
    cfg = llama_config(**CONFIGS["gemma-like"])
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
