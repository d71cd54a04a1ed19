"""GGUF import on tiny files written here: dequantization against independent numpy
references, llama.cpp's q/k row order undone, config and tokenizer from the metadata,
logits equal to the transformers model the file was written from, errors that name the key."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from model.formats.checkpoint import load
from model.formats.convert import main as convert_main
from model.formats.gguf_import import GGUFFile, GGUFImportError, gguf_config, gguf_model, is_gguf_file, load_gguf
from model.formats.sources import load_model
from tests.model.gguf_tiny import (
    CHATML,
    GGUFSpec,
    Q,
    tiny_llama,
    train_byte_bpe,
    transformers,
    write_llama_gguf,
    write_raw_tensor_gguf,
)
from tests.model.hf_tiny import SENTENCES


@pytest.fixture(scope="module")
def bpe():
    return train_byte_bpe()


@pytest.fixture(scope="module")
def reference(bpe):
    return tiny_llama(vocab_size=bpe.get_vocab_size())


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory, reference, bpe) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", reference, bpe)


def _logits_match(ours: torch.nn.Module, reference: torch.nn.Module, vocab: int, atol: float = 1e-4) -> None:
    torch.manual_seed(3)
    ids = torch.randint(0, vocab, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, :1] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what our model uses for padded rows
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=atol, rtol=0)


# --- dequantization -----------------------------------------------------------------------

def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def reference_q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 34)  # f16 scale, 32 x int8
    return _f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)


def reference_q4_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 18)  # f16 scale, 16 bytes: low nibbles are values 0-15, high nibbles 16-31
    q = np.concatenate([b[:, 2:] & 0x0F, b[:, 2:] >> 4], axis=1).astype(np.float32) - 8
    return _f16(b[:, :2]) * q


def reference_q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 20)  # f16 scale, f16 minimum, 16 bytes of nibbles
    q = np.concatenate([b[:, 4:] & 0x0F, b[:, 4:] >> 4], axis=1).astype(np.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q4_k_scale_min(sc: np.ndarray, j: int) -> tuple[int, int]:
    """The j-th 6-bit (scale, min) pair of a Q4_K super-block's 12 packed bytes."""
    if j < 4:
        return sc[j] & 63, sc[j + 4] & 63
    return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)


def reference_q4_k(raw: np.ndarray) -> np.ndarray:
    """Super-blocks of 256: f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles."""
    out = []
    for blk in _blocks(raw, 144):
        d, dmin, sc, qs = _f16(blk[0:2])[0], _f16(blk[2:4])[0], blk[4:16].astype(int), blk[16:].astype(int)
        y = []
        for chunk in range(4):  # 64 values each: 32 low nibbles, then 32 high nibbles
            q = qs[32 * chunk: 32 * chunk + 32]
            s1, m1 = _q4_k_scale_min(sc, 2 * chunk)
            s2, m2 = _q4_k_scale_min(sc, 2 * chunk + 1)
            y += list(d * s1 * (q & 0xF) - dmin * m1) + list(d * s2 * (q >> 4) - dmin * m2)
        out.append(y)
    return np.array(out, dtype=np.float32)


def reference_q6_k(raw: np.ndarray) -> np.ndarray:
    """Super-blocks of 256: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, f16 d."""
    out = []
    for blk in _blocks(raw, 210):
        ql, qh = blk[:128].astype(int), blk[128:192].astype(int)
        sc, d = blk[192:208].view(np.int8).astype(int), _f16(blk[208:210])[0]
        y = np.zeros(256, dtype=np.float32)
        for half in range(2):
            lo, hi, s, base = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
            for i in range(32):
                k = i // 16
                q1 = ((lo[i] & 0xF) | (((hi[i] >> 0) & 3) << 4)) - 32
                q2 = ((lo[i + 32] & 0xF) | (((hi[i] >> 2) & 3) << 4)) - 32
                q3 = ((lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4)) - 32
                q4 = ((lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4)) - 32
                y[base + i], y[base + i + 32] = d * s[k] * q1, d * s[k + 2] * q2
                y[base + i + 64], y[base + i + 96] = d * s[k + 4] * q3, d * s[k + 6] * q4
        out.append(y)
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("qtype, reference_fn, tolerance", [
    (Q.Q8_0, reference_q8_0, 0.02), (Q.Q4_0, reference_q4_0, 0.4), (Q.Q4_1, reference_q4_1, 0.25),
])
def test_block_quants_match_an_independent_reference(qtype, reference_fn, tolerance, tmp_path):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((6, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    f = GGUFFile(write_raw_tensor_gguf(tmp_path / "q.gguf", "w", raw, qtype))
    got = f.take("w").numpy()
    assert got.shape == (6, 64)
    np.testing.assert_array_equal(got, reference_fn(raw).reshape(6, 64))
    assert np.abs(got - values).max() < tolerance  # and it is a quantization of the original (half a step)


def _random_k_blocks(rng: np.random.Generator, rows: int, size: int, scale_at: list[int]) -> np.ndarray:
    raw = rng.integers(0, 256, (rows, size), dtype=np.uint8)  # one 256-value super-block per row
    for at in scale_at:  # small finite f16 scales, so the values are finite and comparable
        raw[:, at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return raw


@pytest.mark.parametrize("qtype, size, scale_at, reference_fn", [
    (Q.Q4_K, 144, [0, 2], reference_q4_k), (Q.Q6_K, 210, [208], reference_q6_k),
])
def test_k_quants_match_an_independent_reference(qtype, size, scale_at, reference_fn, tmp_path):
    raw = _random_k_blocks(np.random.default_rng(1), 4, size, scale_at)  # 4 rows of 256 values
    f = GGUFFile(write_raw_tensor_gguf(tmp_path / "k.gguf", "w", raw, qtype))
    got = f.take("w").numpy()
    assert got.shape == (4, 256)
    np.testing.assert_allclose(got, reference_fn(raw), rtol=1e-6, atol=1e-7)


def test_float_types_load_exactly(tmp_path):
    values = np.random.default_rng(2).standard_normal((3, 32)).astype(np.float32)
    for qtype, encoded in ((Q.F32, values), (Q.F16, values.astype(np.float16)),
                           (Q.BF16, gguf.quants.quantize(values, Q.BF16))):
        f = GGUFFile(write_raw_tensor_gguf(tmp_path / f"{qtype.name}.gguf", "w", encoded, qtype))
        expected = torch.from_numpy(values).to(torch.bfloat16).float() if qtype == Q.BF16 else torch.from_numpy(
            values.astype(np.float16).astype(np.float32) if qtype == Q.F16 else values)
        torch.testing.assert_close(f.take("w"), expected, atol=0, rtol=0)


def test_unsupported_type_names_tensor_and_type(tmp_path):
    raw = np.zeros((2, 110), dtype=np.uint8)  # two Q3_K super-blocks
    f = GGUFFile(write_raw_tensor_gguf(tmp_path / "q3.gguf", "blk.0.ffn_up.weight", raw, Q.Q3_K))
    with pytest.raises(GGUFImportError, match=r"tensor 'blk\.0\.ffn_up\.weight' has type Q3_K.*not supported"):
        f.take("blk.0.ffn_up.weight")


# --- a whole tiny Llama ------------------------------------------------------------------------

def test_config_and_extras_come_from_the_metadata(tiny_file, reference):
    g = load_gguf(tiny_file)
    cfg, hf = g.config, reference.config
    assert (cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.n_decoder_layers, cfg.d_ff, cfg.vocab_size) == (
        hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.num_hidden_layers, hf.intermediate_size,
        hf.vocab_size)
    assert (cfg.positional, cfg.norm, cfg.mlp, cfg.activation, cfg.bias) == ("rope", "rmsnorm", "gated", "silu", False)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None and cfg.max_positions == 64
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    assert g.chat_template == CHATML
    assert g.metadata["license"] == "apache-2.0"


def test_qk_rows_are_back_in_rotate_half_order(tiny_file, reference):
    g = load_gguf(tiny_file)
    hf = reference.model.layers[1].self_attn
    expected = torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight])
    assert torch.equal(g.model.decoder_layers[1].self_attn.qkv_proj.weight, expected)


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_the_model_the_file_was_written_from(tie, tmp_path, bpe):
    reference = tiny_llama(seed=4, vocab_size=bpe.get_vocab_size(), tie=tie)
    g = load_gguf(write_llama_gguf(tmp_path / "m.gguf", reference, bpe))
    assert g.config.tie_word_embeddings == tie
    _logits_match(g.model, reference, g.config.vocab_size)


def test_logits_match_transformers_reading_the_same_file(tiny_file):
    """transformers undoes llama.cpp's permutation with its own code: an independent check."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_file.parent, gguf_file=tiny_file.name,
                                                                  dtype=torch.float32).eval()
    g = load_gguf(tiny_file)
    _logits_match(g.model, reference, g.config.vocab_size)


def test_linear_rope_scaling_is_read_and_applied(tmp_path, bpe):
    reference = tiny_llama(seed=5, vocab_size=bpe.get_vocab_size(), rope_scaling={"rope_type": "linear", "factor": 2.0})
    spec = GGUFSpec(extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    g = load_gguf(write_llama_gguf(tmp_path / "linear.gguf", reference, bpe, spec))
    assert g.config.rope_scaling == {"type": "linear", "factor": 2.0}
    _logits_match(g.model, reference, g.config.vocab_size)


@pytest.mark.parametrize("qtype, bound", [(Q.Q8_0, 0.05), (Q.Q4_1, 0.5), (Q.Q5_0, 0.3), (Q.Q5_1, 0.3)])
def test_quantized_files_give_close_logits(qtype, bound, tmp_path, reference, bpe):
    g = load_gguf(write_llama_gguf(tmp_path / f"{qtype.name}.gguf", reference, bpe, GGUFSpec(qtype=qtype)))
    ids = torch.randint(0, g.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected, got = reference(input_ids=ids).logits, g.model(ids)
    assert (got - expected).norm() / expected.norm() < bound  # relative error of 8-bit / 4-bit weights
    assert any(qtype.name in note for note in g.notes)


def test_stop_ids_from_end_of_turn_metadata(tmp_path, reference, bpe):
    spec = GGUFSpec(extra_kv={"tokenizer.ggml.eot_token_id": 1})
    # 1 as the metadata says; 0 as <|endoftext|>, a control token that ends text (eos is 2, <|im_end|>)
    assert load_gguf(write_llama_gguf(tmp_path / "eot.gguf", reference, bpe, spec)).stop_token_ids == [0, 1]


# --- tokenizer ------------------------------------------------------------------------------

@pytest.mark.parametrize("pre", ["smollm", "llama-bpe"])
def test_tokenizer_matches_transformers_reading_the_same_file(pre, tmp_path, reference, bpe):
    file = write_llama_gguf(tmp_path / "tok.gguf", reference, bpe, GGUFSpec(pre=pre))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    ours = load_gguf(file).tokenizer
    for text in SENTENCES + ["<|im_start|>user\nHallo<|im_end|>\n", "a<|endoftext|>b  \t\n\n  12345 x"]:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    assert ours.token_to_id("<|im_end|>") == 2 and 2 in ours.special_ids


def test_tokenizer_adds_bos_when_the_file_asks(tmp_path, reference, bpe):
    file = write_llama_gguf(tmp_path / "bos.gguf", reference, bpe,
                            GGUFSpec(extra_kv={"tokenizer.ggml.add_bos_token": True}))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    ours = load_gguf(file).tokenizer
    assert ours.encode("Hello world")[0] == 1
    assert ours.encode("Hello world") == ref("Hello world")["input_ids"]
    assert ours.encode("Hello world", add_special_tokens=False)[0] != 1


# --- conversion and loading -------------------------------------------------------------------

def test_convert_and_load_model_keep_weights_template_and_tokenizer(tiny_file, tmp_path):
    assert is_gguf_file(tiny_file) and not is_gguf_file(tmp_path)
    assert convert_main([str(tiny_file), str(tmp_path / "ckpt")]) == 0
    ckpt, direct = load(tmp_path / "ckpt"), load_model(tiny_file)
    assert ckpt.config == direct.config
    assert ckpt.chat_template == direct.chat_template == CHATML
    assert (tmp_path / "ckpt" / "chat_template.jinja").is_file()
    ids = torch.tensor([direct.tokenizer.encode(SENTENCES[0])])
    with torch.no_grad():
        assert torch.equal(ckpt.model(ids), direct.model(ids))
    assert [ckpt.tokenizer.encode(t) for t in SENTENCES] == [direct.tokenizer.encode(t) for t in SENTENCES]
    card = (tmp_path / "ckpt" / "README.md").read_text()
    assert "GGUF" in card and "apache-2.0" in card


# --- bad files --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    (GGUFSpec(architecture="gpt2"),
     r"metadata 'general\.architecture' is 'gpt2'; supported: \['llama', 'qwen2', 'qwen3', 'gemma3', 'phi3'\]"),
    (GGUFSpec(drop_keys=("llama.attention.layer_norm_rms_epsilon",)),
     r"metadata 'llama\.attention\.layer_norm_rms_epsilon' is missing"),
    (GGUFSpec(drop_keys=("llama.block_count",)), r"metadata 'llama\.block_count' is missing"),
    (GGUFSpec(extra_kv={"llama.rope.dimension_count": 4}), r"'llama\.rope\.dimension_count' is 4; only 8"),
    (GGUFSpec(extra_kv={"llama.rope.scaling.type": "yarn"}), r"'llama\.rope\.scaling\.type' is 'yarn'"),
    (GGUFSpec(tokenizer_model="llama"), r"'tokenizer\.ggml\.scores' is missing"),  # SentencePiece needs scores
    (GGUFSpec(tokenizer_model="bert"), r"'tokenizer\.ggml\.model' is 'bert'; supported: 'gpt2'.*'llama'"),
    (GGUFSpec(extra_tensors={"rope_freqs.weight": (np.ones(4, dtype=np.float32), Q.F32)}),
     r"tensor 'rope_freqs\.weight'.*not supported"),
    (GGUFSpec(extra_tensors={"blk.0.attn_q.bias": (np.ones(32, dtype=np.float32), Q.F32)}),
     r"tensor\(s\) \['blk\.0\.attn_q\.bias'\] are not used"),
])
def test_unsupported_files_fail_naming_the_key(spec, message, tmp_path, reference, bpe):
    file = write_llama_gguf(tmp_path / "bad.gguf", reference, bpe, spec)
    with pytest.raises(GGUFImportError, match=message):
        load_gguf(file)


def test_missing_tensor_is_named(tmp_path, reference, bpe):
    f = GGUFFile(write_llama_gguf(tmp_path / "ok.gguf", reference, bpe))
    f.tensors.pop("blk.1.ffn_gate.weight")
    with pytest.raises(GGUFImportError, match=r"missing tensor 'blk\.1\.ffn_gate\.weight'"):
        gguf_model(f, gguf_config(f))


def test_not_a_gguf_file(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFImportError, match=r"not a readable GGUF file"):
        load_gguf(junk)
    with pytest.raises(GGUFImportError, match=r"file not found"):
        load_gguf(tmp_path / "absent.gguf")
