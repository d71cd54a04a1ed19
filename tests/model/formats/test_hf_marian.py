"""Marian imported from the Hugging Face layout matches transformers: model, generation, tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import sentencepiece
import torch
from safetensors.torch import load_file, save_file

from model import generate
from model.engine.sampling import SamplingParams
from model.formats.checkpoint import load
from model.formats.convert import main as convert_main
from model.formats.hf.importer import HFImportError, load_hf
from model.nn.layers import sinusoidal_table
from model.nn.transformer import EncoderDecoder
from model.tokenization.spm import CONTROL, NORMAL, UNKNOWN, read_sentencepiece
from tests.model.hf_tiny import ENGLISH, GERMAN, SENTENCES, Imported, build_and_import, save_marian

# MarianTokenizer warns that sacremoses is missing; it is only used by a normalize() that encoding never calls.
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> Imported:
    return build_and_import(tmp_path_factory.mktemp("hf-marian"), save_marian)


def test_marian_becomes_an_encoder_decoder(marian):
    reference, ours = marian.reference, marian.ours
    assert isinstance(ours.model, EncoderDecoder)
    assert ours.config.decoder_start_token_id == reference.config.pad_token_id
    assert ours.notes and "bad_words_ids" in ours.notes[0]


def test_marian_logits_match_with_source_padding(marian):
    reference, ours = marian.reference, marian.ours
    pad = reference.config.pad_token_id
    torch.manual_seed(3)
    src = torch.randint(0, pad, (3, 11))
    src_mask = torch.ones(3, 11, dtype=torch.long)
    src_mask[1, -4:] = 0
    src[1, -4:] = pad
    tgt = torch.randint(0, pad, (3, 9))
    tgt[:, 0] = pad  # the decoder starts from pad
    with torch.no_grad():
        expected = reference(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
        got = ours.model(src, tgt, src_mask=src_mask)
    # generation_config bans <pad>; the import folds that ban into the output bias.
    assert torch.isneginf(got[..., pad]).all()
    keep = torch.arange(got.size(-1)) != pad
    torch.testing.assert_close(got[..., keep], expected[..., keep], atol=1e-4, rtol=0)


def test_marian_greedy_generation_matches_with_kv_cache(marian):
    reference, tokenizer, ours = marian.reference, marian.reference_tokenizer, marian.ours
    sources = [ours.tokenizer.encode(text) for text in ENGLISH[:4]]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    results = generate(ours.model, sources, params, ours.tokenizer)
    for source, result in zip(sources, results):
        # eos_token_id=None keeps transformers going as ignore_eos does; bad_words_ids come from
        # the saved generation_config.json, as for the published models.
        out = reference.generate(torch.tensor([source]), max_new_tokens=24, do_sample=False, num_beams=1,
                                 eos_token_id=None)
        assert result.token_ids == out[0, 1:].tolist()  # out[0, 0] is the decoder start token
        assert len(result.token_ids) == 24
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert len({tuple(r.token_ids) for r in results}) > 1


def test_marian_tokenizer_matches_on_sentences(marian):
    tokenizer, ours = marian.reference_tokenizer, marian.ours
    for text in SENTENCES + ENGLISH + GERMAN + [">>de<< Hello world", ">>de<<Hello"]:
        assert ours.tokenizer.encode(text) == tokenizer(text)["input_ids"], text
    # "ß" is no piece of the English source model: MarianTokenizer looks the unknown character up
    # in vocab.json, where the German side put it, and so must we.
    source_pieces = {piece for piece, _, _ in read_sentencepiece((marian.directory / "source.spm").read_bytes()).pieces}
    assert "ß" not in source_pieces
    assert tokenizer.convert_tokens_to_ids("ß") in ours.tokenizer.encode("Straße")


def test_marian_decoding_matches_on_target_sentences(marian):
    tokenizer, ours = marian.reference_tokenizer, marian.ours
    for text in GERMAN:
        ids = tokenizer(text_target=text)["input_ids"]
        assert ours.tokenizer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_sentencepiece_reader_agrees_with_sentencepiece(marian):
    proto = (marian.directory / "source.spm").read_bytes()
    ours = read_sentencepiece(proto)
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
    assert len(ours.pieces) == sp.get_piece_size()
    for i, (piece, score, kind) in enumerate(ours.pieces):
        assert piece == sp.id_to_piece(i)
        assert score == pytest.approx(sp.get_score(i), abs=1e-6)
        expected = UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else NORMAL
        assert kind == expected
    assert ours.precompiled_charsmap  # nmt_nfkc by default
    assert ours.add_dummy_prefix and ours.remove_extra_whitespaces and ours.split_by_whitespace


def test_converted_marian_checkpoint_loads_with_identical_logits(marian, tmp_path):
    ours = marian.ours
    assert convert_main([str(marian.directory), str(tmp_path / "ckpt")]) == 0
    ckpt = load(tmp_path / "ckpt")
    assert ckpt.config == ours.config
    src = torch.tensor([ours.tokenizer.encode(ENGLISH[1])])
    tgt = torch.tensor([[ours.config.decoder_start_token_id, 5, 9, 7]])
    with torch.no_grad():
        assert torch.equal(ckpt.model(src, tgt), ours.model(src, tgt))
    assert [ckpt.tokenizer.encode(t) for t in SENTENCES] == [ours.tokenizer.encode(t) for t in SENTENCES]
    assert "bad_words_ids" in (tmp_path / "ckpt" / "README.md").read_text()


# --- stored position tables and unsupported variants ----------------------------------------

def _copy(src: Path, dst: Path, config: dict | None = None, tokenizer_config: dict | None = None,
          add: dict[str, torch.Tensor] | None = None) -> Path:
    shutil.copytree(src, dst)
    for name, change in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if change:
            data = json.loads((dst / name).read_text())
            data.update(change)
            (dst / name).write_text(json.dumps(data))
    if add:
        tensors = load_file(dst / "model.safetensors")
        tensors.update(add)
        save_file(tensors, dst / "model.safetensors")
    return dst


def test_stored_position_tables_are_checked(marian, tmp_path):
    directory, reference, ours = marian.directory, marian.reference, marian.ours
    hf_table = reference.model.encoder.embed_positions.weight.detach().clone()  # what transformers computes
    good = _copy(directory, tmp_path / "good", add={"model.encoder.embed_positions.weight": hf_table,
                                                    "model.decoder.embed_positions.weight": hf_table.clone()})
    assert load_hf(good).config == ours.config
    interleaved = sinusoidal_table(hf_table.size(0), hf_table.size(1), "interleaved")
    bad = _copy(directory, tmp_path / "bad", add={"model.encoder.embed_positions.weight": interleaved})
    with pytest.raises(HFImportError, match=r"model\.encoder\.embed_positions\.weight.*sinusoid"):
        load_hf(bad)


@pytest.mark.parametrize("config, tokenizer_config, message", [
    ({"decoder_vocab_size": 7}, None, r"decoder_vocab_size=7.*not supported"),
    ({"share_encoder_decoder_embeddings": False}, None, r"share_encoder_decoder_embeddings=False.*not supported"),
    ({"decoder_ffn_dim": 128}, None, r"decoder_ffn_dim=128.*not supported.*encoder_ffn_dim"),
    (None, {"separate_vocabs": True}, r"separate source/target vocabularies"),
])
def test_unsupported_marian_variants_are_named(marian, tmp_path, config, tokenizer_config, message):
    bad = _copy(marian.directory, tmp_path / "bad", config=config, tokenizer_config=tokenizer_config)
    with pytest.raises(HFImportError, match=message):
        load_hf(bad)


def test_source_pieces_missing_from_the_vocabulary_are_named(marian, tmp_path):
    bad = _copy(marian.directory, tmp_path / "bad")
    spm = read_sentencepiece((bad / "source.spm").read_bytes())
    longest = max((p for p, _, kind in spm.pieces if kind == NORMAL), key=len)
    vocab = json.loads((bad / "vocab.json").read_text())
    del vocab[longest]
    vocab = {piece: i for i, piece in enumerate(vocab)}  # keep the ids dense
    (bad / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(HFImportError, match=rf"source\.spm.*not in the vocabulary.*{longest}"):
        load_hf(bad)


@pytest.mark.parametrize("tokenizer_config, languages", [
    ({"source_lang": "en", "target_lang": "de"}, ("en", "de")),  # as transformers' conversion writes it
    ({"source_lang": "eng", "target_lang": "DEU"}, ("eng", "deu")),
    ({"source_lang": "en", "target_lang": "ROMANCE"}, (None, None)),  # a group of languages: unknown
    ({"source_lang": None, "target_lang": None}, (None, None)),
])
def test_the_language_pair_comes_from_the_tokenizer_config(marian, tmp_path, tokenizer_config, languages):
    assert (marian.ours.config.source_language, marian.ours.config.target_language) == (None, None)
    config = load_hf(_copy(marian.directory, tmp_path / "pair", tokenizer_config=tokenizer_config)).config
    assert (config.source_language, config.target_language) == languages
