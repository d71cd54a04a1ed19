"""The activation-precision study rounds as the native step's ``KqActs::quantize`` does, per block,
and its hooks reach every linear layer (the head included) and leave nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.studies.activation_precision import (
    SCHEMES,
    Reference,
    blocks_for,
    fake_quantize,
    first_difference,
    forced,
    gguf_tensor,
    greedy,
    kernel_block,
    quantized_inputs,
)

# with max |x| = 127, L = 127 makes 127 / max exactly 1, so x * inv is x and the rounding is visible:
# halves go to the even neighbour, the rest to the nearest
BLOCK = torch.tensor([127.0, 0.5, 1.5, 2.5, -3.5, -0.5, 0.25, -126.75] * 4)
ROUNDED = torch.tensor([127.0, 0.0, 2.0, 2.0, -4.0, -0.0, 0.0, -127.0] * 4)


def test_a_block_whose_max_is_L_rounds_half_to_even_and_keeps_its_max():
    assert torch.equal(fake_quantize(BLOCK, 32, 127), ROUNDED)


def test_each_block_has_its_own_scale():
    # the second block is the first halved: 127 / 63.5 = 2 exactly, the same integers, scale 0.5;
    # a block of zeros stays zeros (the kernel's scale 0, inverse 0)
    x = torch.cat([BLOCK, BLOCK / 2, torch.zeros(32)]).reshape(1, 96)
    got = fake_quantize(x, 32, 127)[0]
    assert torch.equal(got[:32], ROUNDED)
    assert torch.equal(got[32:64], ROUNDED / 2)
    assert torch.equal(got[64:], torch.zeros(32))
    # one block of 64 instead: the first block's max sets every scale, so the halved values change grid
    assert not torch.equal(fake_quantize(x[:, :64], 64, 127), got[:64].reshape(1, 64))


def test_the_max_maps_to_plus_or_minus_L_and_every_value_onto_L_levels():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    x[1, 7] = -50.0  # a negative max
    for levels, block in ((127, 32), (127, 256), (32767, 256), (7, 16)):
        got = fake_quantize(x, block, levels).reshape(4, -1, block)
        scale = x.reshape(4, -1, block).abs().amax(-1, keepdim=True) / levels
        steps = got / scale
        # r * scale / scale: within float32 rounding of an integer in [-L, L]
        assert (steps - steps.round()).abs().max() <= 1e-6 * levels
        assert steps.round().abs().amax(-1).eq(levels).all()
        # rounding to nearest: no value moves more than half a step (plus float32's rounding of
        # x * inv, a few units in the last place of a number up to L)
        assert ((got - x.reshape(4, -1, block)).abs() <= scale * (0.5 + levels * 2.0**-21)).all()
    assert fake_quantize(x, 32, 127)[1, 7] == pytest.approx(-50.0, rel=1e-6)


def test_blocks_must_divide_the_last_dimension():
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        fake_quantize(torch.ones(2, 896), 256, 127)


def test_kernel_blocks_and_gguf_names():
    assert [kernel_block(t) for t in ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")] == \
        [256] * 3 + [32] * 5
    with pytest.raises(ValueError, match="F16"):
        kernel_block("F16")
    tensors = {"token_embd.weight", "blk.3.attn_q.weight", "blk.3.ffn_down.weight"}
    assert gguf_tensor("model.layers.3.self_attn.q_proj", tensors) == "blk.3.attn_q.weight"
    assert gguf_tensor("model.layers.3.mlp.down_proj", tensors) == "blk.3.ffn_down.weight"
    assert gguf_tensor("lm_head", tensors) == "token_embd.weight"  # tied
    assert gguf_tensor("lm_head", tensors | {"output.weight"}) == "output.weight"
    with pytest.raises(ValueError, match="does not hold"):
        gguf_tensor("model.layers.4.self_attn.q_proj", tensors)


@pytest.fixture(scope="module")
def tiny():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    # the file's types as a Q4_K_M mix would have them: ffn_down a K-quant (blocks of 256), the rest Q5_0
    types = {"output.weight": "Q8_0", "token_embd.weight": "Q5_0"}
    for i in range(2):
        types |= {f"blk.{i}.{p}.weight": "Q5_0" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                            "ffn_up")}
        types[f"blk.{i}.ffn_down.weight"] = "Q4_K"
    return model, types


@torch.inference_mode()
def test_scheme_none_leaves_the_logits_as_they_are_and_shipped_rounds_every_linear(tiny):
    model, types = tiny
    ids = torch.tensor([[1, 5, 9, 33, 2, 60, 17]])
    plain = model(ids).logits
    with quantized_inputs(model, blocks_for(model, types, SCHEMES["none"]), None):
        assert torch.equal(model(ids).logits, plain)
    shipped = blocks_for(model, types, SCHEMES["shipped"])
    assert shipped["model.layers.1.mlp.down_proj"] == 256 and shipped["model.layers.1.self_attn.q_proj"] == 32
    assert shipped["lm_head"] == 32
    x = torch.randn(3, 256)
    with quantized_inputs(model, shipped, 127):
        rounded = model(ids).logits
        # each layer sees its input rounded per its own block: the head per 32, down_proj per 256
        head = model.lm_head
        assert torch.equal(head(x[:, :64]), nn.functional.linear(fake_quantize(x[:, :64], 32, 127), head.weight))
        down = model.model.layers[0].mlp.down_proj
        assert torch.equal(down(x), nn.functional.linear(fake_quantize(x, 256, 127), down.weight))
    assert not torch.equal(rounded, plain)
    # the hooks are gone after
    assert torch.equal(model(ids).logits, plain)


def test_every_linear_layer_must_have_a_block(tiny):
    model, types = tiny
    blocks = blocks_for(model, types, SCHEMES["shipped"])
    del blocks["lm_head"]
    with pytest.raises(ValueError, match="lm_head"):
        with quantized_inputs(model, blocks, 127):
            pass


@torch.inference_mode()
def test_an_answer_generated_from_the_first_difference_is_the_whole_one_where_no_tie_is_near(tiny):
    # a tiny model's logits are far apart, so one pass and step by step choose alike (on the real
    # models, near ties under int8 rounding make them differ: --from-divergence only screens)
    model, types = tiny
    reference = Reference(Path("unused.gguf"))
    reference._model = model
    prompt, n, eos = [1, 5, 9, 33, 2], 12, None
    ref_answer = reference.generate(prompt, n, eos)
    # 3 levels a block: coarse enough that the answer leaves the reference's early
    with quantized_inputs(model, blocks_for(model, types, SCHEMES["shipped"]), 3):
        choices = forced(model, prompt, ref_answer)
        whole = reference.generate(prompt, n, eos)
        assert first_difference(choices, ref_answer) is not None and whole != ref_answer
        assert whole[first_difference(choices, ref_answer)] == choices[first_difference(choices, ref_answer)]
        assert greedy(reference, prompt, ref_answer, choices, n, eos) == whole
    # an answer teacher forcing never leaves is the reference's, not generated again
    assert greedy(reference, prompt, ref_answer, forced(model, prompt, ref_answer), n, eos) == ref_answer
