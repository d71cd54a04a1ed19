"""GGUF files of Qwen2, Qwen3, Mistral (general.architecture "llama"), Phi-3 and Gemma 3, written
here as llama.cpp lays them out: through model.load_model the logits match transformers reading
the same file (gguf_file=) within 1e-4 and greedy outputs are identical; the SentencePiece
vocabularies give the same ids as transformers rebuilds from the file."""

from __future__ import annotations

import pytest
import torch

from model import SamplingParams, generate
from model.formats.gguf_import import GGUFImportError, load_gguf
from model.formats.sources import load_model
from tests.model.gguf_lineages import PHI3_LONGROPE, VARIANTS, write_lineage_gguf
from tests.model.hf_tiny import SENTENCES, transformers

TEXTS = SENTENCES + [
    " leading space", "trailing space ", "two  spaces", "\n\nnew lines\n", "<s> literal", "ünïcødé ✓ 𝔘",
    "The café in Köln<start_of_turn>user", "x" * 40,
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}
    for i, key in enumerate(VARIANTS):
        directory = tmp_path_factory.mktemp(key)
        path, _ = write_lineage_gguf(directory / f"{key}.gguf", key, seed=i)
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=path.name,
                                                                      dtype=torch.float32).eval()
        out[key] = path, reference
    return out


@pytest.mark.parametrize("key", list(VARIANTS))
def test_logits_match_transformers_reading_the_same_file(key, files):
    path, reference = files[key]
    ours = load_model(path)
    assert ours.config.n_decoder_layers == reference.config.num_hidden_layers
    torch.manual_seed(3)
    ids = torch.randint(4, ours.config.vocab_size, (2, 30))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        got = ours.model(ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("key", list(VARIANTS))
def test_greedy_generation_and_tokens_match(key, files):
    path, reference = files[key]
    ours = load_model(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == tokenizer(text)["input_ids"], text
    prompts = [ours.tokenizer.encode(t) for t in ("The quick brown fox", "Wo ist bitte der Bahnhof?")]
    results = generate(ours.model, prompts, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=ours.config.pad_token_id)
        assert result.token_ids == out[0, len(prompt):].tolist()


def test_config_of_each_lineage(files):
    cfg = load_gguf(files["qwen2"][0]).config
    assert cfg.qkv_bias and not cfg.tie_word_embeddings
    cfg = load_gguf(files["qwen3"][0]).config
    assert cfg.qk_norm and cfg.head_dim == 128
    cfg = load_gguf(files["gemma3"][0]).config
    assert (cfg.sliding_window, cfg.sliding_window_layers, cfg.local_rope_theta) == (8, [0, 1, 2, 3, 4], 10_000.0)
    assert cfg.post_sublayer_norm and cfg.scale_embedding and cfg.attention_scale == 256 ** -0.5
    assert load_gguf(files["mistral"][0]).config.head_dim_override == 16


def test_sentencepiece_decoding_round_trips(files):
    for key in ("mistral", "gemma3", "phi3"):
        path, _ = files[key]
        ours = load_gguf(path).tokenizer
        reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        for text in TEXTS:
            ids = ours.encode(text)
            assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), (key, text)


@pytest.mark.parametrize("extra, needle", [
    ({"gemma3.attn_logit_softcapping": 50.0}, r"'gemma3\.attn_logit_softcapping' is set; logit soft-capping"),
    ({"gemma3.rope.dimension_count": 128}, r"'gemma3\.rope\.dimension_count' is 128; only 256"),
])
def test_unsupported_gemma3_settings_are_named(extra, needle, tmp_path):
    path, _ = write_lineage_gguf(tmp_path / "bad.gguf", "gemma3", extra_kv=extra)
    with pytest.raises(GGUFImportError, match=needle):
        load_gguf(path)


def test_an_unsupported_architecture_is_named_with_the_supported_list(tmp_path):
    path, _ = write_lineage_gguf(tmp_path / "bad.gguf", "qwen2", extra_kv={"general.architecture": "falcon"})
    with pytest.raises(GGUFImportError, match=r"'falcon'; supported: \['llama', 'qwen2', 'qwen3', 'gemma3', 'phi3'\]"):
        load_gguf(path)


def test_phi3_longrope_and_window_from_gguf_match_the_model_it_was_written_from(tmp_path):
    """transformers drops llama.cpp's LongRoPE factors when it reads a GGUF; we read them (the
    short factors and the attention factor, context capped at the original length)."""
    path, reference = write_lineage_gguf(tmp_path / "longrope.gguf", PHI3_LONGROPE, seed=5)
    ours = load_model(path)
    assert ours.config.max_positions == 64 and ours.config.rope_scaling["type"] == "longrope"
    assert ours.config.sliding_window == 8
    ids = torch.randint(4, ours.config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(ids), reference(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_a_llama_file_with_a_sliding_window_gets_it_on_every_layer(tmp_path):
    """Mistral as a "llama" GGUF: a window the file states is applied (llama.cpp's converter
    writes none; transformers reads none and keeps Mistral's 4096, longer than this context)."""
    path, _ = write_lineage_gguf(tmp_path / "m.gguf", "mistral", extra_kv={"llama.attention.sliding_window": 8})
    cfg = load_gguf(path).config
    assert (cfg.sliding_window, cfg.sliding_window_layers) == (8, None)
    path, _ = write_lineage_gguf(tmp_path / "long.gguf", "mistral", extra_kv={"llama.attention.sliding_window": 4096})
    assert load_gguf(path).config.sliding_window is None  # no shorter than the context: changes nothing
