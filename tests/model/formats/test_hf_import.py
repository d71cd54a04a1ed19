"""GPT-2 and BERT imported from the Hugging Face layout match transformers; bad directories fail by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model import generate
from model.engine.sampling import SamplingParams
from model.formats.checkpoint import load
from model.formats.convert import main as convert_main
from model.formats.hf.importer import HFImportError, is_hf_model_dir, load_hf
from model.nn.transformer import DecoderLM, MaskedLM
from tests.model.hf_tiny import ENGLISH, SENTENCES, Imported, build_and_import, save_bert, save_gpt2, transformers


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Imported:
    return build_and_import(tmp_path_factory.mktemp("hf-gpt2"), save_gpt2)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Imported:
    return build_and_import(tmp_path_factory.mktemp("hf-bert"), save_bert)


def _padding_mask(batch: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, -4:] = 0  # right padding
    return mask


# --- GPT-2 ------------------------------------------------------------------------------

def test_gpt2_becomes_a_decoder_lm(gpt2):
    assert isinstance(gpt2.ours.model, DecoderLM)
    assert gpt2.ours.config.vocab_size == gpt2.reference.config.vocab_size
    assert is_hf_model_dir(gpt2.directory)


def test_gpt2_logits_match_with_padding(gpt2):
    torch.manual_seed(1)
    ids = torch.randint(0, gpt2.ours.config.vocab_size, (3, 12))
    mask = _padding_mask(3, 12)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what our model uses for padded rows
    with torch.no_grad():
        expected = gpt2.reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = gpt2.ours.model(ids, attention_mask=mask)
        unpadded = gpt2.reference(input_ids=ids).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=0)
    torch.testing.assert_close(gpt2.ours.model(ids).detach(), unpadded, atol=1e-4, rtol=0)


def test_gpt2_greedy_generation_matches_with_kv_cache(gpt2):
    prompts = [gpt2.reference_tokenizer(text)["input_ids"] for text in ENGLISH[:3]]  # ragged batch
    ours = generate(gpt2.ours.model, prompts, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, ours):
        # eos_token_id=None: transformers must not stop early either (we ignore eos above).
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        out = gpt2.reference.generate(torch.tensor([prompt]), attention_mask=mask,
                                      max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert result.token_ids == out[0, len(prompt):].tolist()
        assert len(result.token_ids) == 24
    assert len({tuple(r.token_ids) for r in ours}) > 1  # the prompts matter: not one degenerate loop


def test_gpt2_tokenizer_matches(gpt2):
    for text in SENTENCES + ENGLISH:
        ids = gpt2.ours.tokenizer.encode(text)
        assert ids == gpt2.reference_tokenizer(text)["input_ids"], text
        assert gpt2.ours.tokenizer.decode(ids) == gpt2.reference_tokenizer.decode(ids, skip_special_tokens=True)


# --- BERT -------------------------------------------------------------------------------

def test_bert_becomes_a_masked_lm(bert):
    assert isinstance(bert.ours.model, MaskedLM)
    assert bert.ours.config.mask_token_id == bert.reference_tokenizer.mask_token_id


def test_bert_logits_match_with_padding_and_token_types(bert):
    torch.manual_seed(2)
    ids = torch.randint(0, bert.ours.config.vocab_size, (3, 12))
    types = torch.randint(0, 2, (3, 12))
    mask = _padding_mask(3, 12)
    with torch.no_grad():
        expected = bert.reference(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        got = bert.ours.model(ids, attention_mask=mask, token_type_ids=types)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_bert_fill_mask_top5_matches_the_pipeline(bert):
    fill = transformers.pipeline("fill-mask", model=bert.reference, tokenizer=bert.reference_tokenizer, top_k=5)
    mask_id = bert.ours.config.mask_token_id
    for text in ["The quick brown [MASK] jumps.", "Where is the [MASK] station?", "Viele [MASK] aus Köln."]:
        expected = fill(text)
        ids = bert.ours.tokenizer.encode(text)
        with torch.no_grad():
            probs = bert.ours.model(torch.tensor([ids]))[0, ids.index(mask_id)].softmax(-1)
        top = probs.topk(5)
        assert top.indices.tolist() == [e["token"] for e in expected], text
        torch.testing.assert_close(top.values, torch.tensor([e["score"] for e in expected]), atol=1e-5, rtol=0)


def test_bert_tokenizer_matches(bert):
    for text in SENTENCES + ENGLISH:
        ids = bert.ours.tokenizer.encode(text)
        assert ids == bert.reference_tokenizer(text)["input_ids"], text
        pair = bert.ours.tokenizer.tk.encode(text, "second part")
        reference = bert.reference_tokenizer(text, "second part")
        assert (pair.ids, pair.type_ids) == (reference["input_ids"], reference["token_type_ids"])


# --- conversion to our checkpoint format ---------------------------------------------------

@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_converted_checkpoint_loads_with_identical_logits(name, request, tmp_path):
    imported: Imported = request.getfixturevalue(name)
    assert convert_main([str(imported.directory), str(tmp_path / "ckpt")]) == 0
    ckpt = load(tmp_path / "ckpt")
    assert ckpt.config == imported.ours.config
    ids = torch.tensor([imported.ours.tokenizer.encode(text) for text in ENGLISH[:1]])
    with torch.no_grad():
        assert torch.equal(ckpt.model(ids), imported.ours.model(ids))
    assert [ckpt.tokenizer.encode(t) for t in SENTENCES] == [imported.ours.tokenizer.encode(t) for t in SENTENCES]
    assert imported.ours.architecture in (tmp_path / "ckpt" / "README.md").read_text()


def test_convert_stores_the_requested_dtype(gpt2, tmp_path):
    assert convert_main([str(gpt2.directory), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        names = f.keys()
        assert {f.get_tensor(name).dtype for name in names} == {torch.bfloat16}
    ckpt = load(tmp_path / "bf16")
    ids = torch.tensor([gpt2.ours.tokenizer.encode(ENGLISH[0])])
    with torch.no_grad():
        full, half = gpt2.ours.model(ids), ckpt.model(ids).float()
    assert (half - full).abs().max() < 0.05 * full.abs().max()


def test_convert_refuses_to_overwrite_and_reports_errors(gpt2, tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    assert convert_main([str(gpt2.directory), str(tmp_path / "busy")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert convert_main(["openai-community/gpt2", str(tmp_path / "out")]) == 2
    assert "not a local directory" in capsys.readouterr().err


def test_sharded_safetensors_are_read(gpt2, tmp_path):
    sharded = tmp_path / "sharded"
    gpt2.reference.save_pretrained(sharded, max_shard_size="40KB")
    shutil.copy(gpt2.directory / "tokenizer.json", sharded)
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    ids = torch.tensor([gpt2.ours.tokenizer.encode(ENGLISH[2])])
    with torch.no_grad():
        assert torch.equal(load_hf(sharded).model(ids), gpt2.ours.model(ids))


# --- bad directories ----------------------------------------------------------------------

def test_our_own_checkpoints_are_pointed_to_the_right_loader(gpt2, tmp_path):
    assert convert_main([str(gpt2.directory), str(tmp_path / "ours")]) == 0
    assert not is_hf_model_dir(tmp_path / "ours")
    with pytest.raises(HFImportError, match=r"already in our checkpoint format"):
        load_hf(tmp_path / "ours")


def _copy(src: Path, dst: Path, config: dict | None = None, drop: str | None = None,
          add: dict[str, torch.Tensor] | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "config.json").read_text())
        data.update(config)
        (dst / "config.json").write_text(json.dumps(data))
    if drop or add:
        tensors = load_file(dst / "model.safetensors")
        tensors.pop(drop, None)
        tensors.update(add or {})
        save_file(tensors, dst / "model.safetensors")
    return dst


def test_unknown_architecture_is_named(gpt2, tmp_path):
    bad = _copy(gpt2.directory, tmp_path / "falcon", config={"architectures": ["FalconForCausalLM"]})
    with pytest.raises(HFImportError, match=r"FalconForCausalLM.*not supported.*GPT2LMHeadModel"):
        load_hf(bad)


def test_missing_tensor_is_named(gpt2, tmp_path):
    bad = _copy(gpt2.directory, tmp_path / "missing", drop="transformer.h.1.mlp.c_fc.weight")
    with pytest.raises(HFImportError, match=r"missing tensor 'transformer\.h\.1\.mlp\.c_fc\.weight'"):
        load_hf(bad)


def test_tensors_the_config_does_not_describe_are_named(gpt2, tmp_path):
    bad = _copy(gpt2.directory, tmp_path / "fewer-layers", config={"n_layer": 1})
    with pytest.raises(HFImportError, match=r"transformer\.h\.1\..* not used"):
        load_hf(bad)


def test_shape_mismatch_is_named(gpt2, tmp_path):
    bad = _copy(gpt2.directory, tmp_path / "positions", config={"n_positions": 32})
    with pytest.raises(HFImportError, match=r"'transformer\.wpe\.weight' has shape \[64, 32\].*\[32, 32\]"):
        load_hf(bad)


@pytest.mark.parametrize("fixture, change, field", [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ("gpt2", {"activation_function": "quick_gelu"}, "activation_function"),
    ("bert", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
])
def test_unsupported_config_values_are_named(fixture, change, field, request, tmp_path):
    bad = _copy(request.getfixturevalue(fixture).directory, tmp_path / "bad", config=change)
    with pytest.raises(HFImportError, match=rf"{field}=.*not supported"):
        load_hf(bad)


def test_pickled_weights_are_refused(gpt2, tmp_path):
    bad = tmp_path / "pickled"
    bad.mkdir()
    shutil.copy(gpt2.directory / "config.json", bad)
    shutil.copy(gpt2.directory / "tokenizer.json", bad)
    (bad / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(HFImportError, match=r"pytorch_model\.bin.*never loaded.*safetensors"):
        load_hf(bad)


def test_missing_tokenizer_is_named(bert, tmp_path):
    bad = _copy(bert.directory, tmp_path / "no-tokenizer")
    (bad / "tokenizer.json").unlink()
    with pytest.raises(HFImportError, match=r"tokenizer\.json: file not found"):
        load_hf(bad)
