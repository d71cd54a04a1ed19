"""Converted GGUF weights are cached by what they depend on, read back identical, rebuilt when
an entry is damaged or the converter changes, and never required (off, or not writable)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from model.formats import import_cache
from model.formats.gguf_import import load_gguf
from model.formats.manifest import Manifest
from model.formats.sources import as_checkpoint
from tests.model.gguf_tiny import CHATML, GGUFSpec, Q, tiny_llama, train_byte_bpe, write_llama_gguf
from tests.model.hf_tiny import SENTENCES


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    bpe = train_byte_bpe()
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_llama(vocab_size=bpe.get_vocab_size()),
                            bpe)


@pytest.fixture
def manifest(tmp_path) -> Manifest:
    directory = tmp_path / "weights" / "tiny"
    directory.mkdir(parents=True)
    return Manifest(directory / "manifest.json", "gguf", "tiny-pkg", "1.0", "tiny.gguf", "ab" * 32, "MIT")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TSERVE_WEIGHTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(import_cache.SWITCH_ENV, raising=False)
    monkeypatch.setenv("TSERVE_GGUF_WEIGHTS", "float")  # the import the cache keeps (stored blocks need none)
    return tmp_path / "cache" / import_cache.SUBDIR


class Converter:
    """The import, counting how often it runs."""

    def __init__(self, file: Path, manifest: Manifest):
        self.file, self.manifest, self.calls = file, manifest, 0

    def __call__(self):
        self.calls += 1
        return as_checkpoint(load_gguf(self.file), self.manifest.path.parent)


def same(a, b) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.config == b.config and a.chat_template == b.chat_template and a.stop_token_ids == b.stop_token_ids
    assert [a.tokenizer.encode(t) for t in SENTENCES] == [b.tokenizer.encode(t) for t in SENTENCES]
    assert a.path == b.path


def test_converted_once_then_read_back_identical(tiny_file, manifest, cache):
    convert = Converter(tiny_file, manifest)
    direct = convert()
    first = import_cache.load_converted(manifest, convert)
    second = import_cache.load_converted(manifest, convert)
    assert convert.calls == 2  # the direct import above, then the first load; the second is the cache's
    same(first, direct)
    same(second, direct)
    assert second.chat_template == CHATML and second.path == manifest.path.parent
    (entry,) = cache.iterdir()
    assert entry.name.startswith(manifest.sha256[:16] + "-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "source.json"} <= {p.name for p in entry.iterdir()}
    assert not list(cache.glob(".*"))  # no temporary directory left


def test_dtype_is_applied_to_cached_weights(tiny_file, manifest, cache):
    convert = Converter(tiny_file, manifest)
    import_cache.load_converted(manifest, convert)
    half = import_cache.load_converted(manifest, convert, dtype=torch.bfloat16)
    assert half.model.embed.tokens.weight.dtype == torch.bfloat16 and convert.calls == 1


def test_a_damaged_entry_is_rebuilt_with_a_warning(tiny_file, manifest, cache, caplog):
    convert = Converter(tiny_file, manifest)
    direct = import_cache.load_converted(manifest, convert)
    (entry,) = cache.iterdir()
    weights = entry / "model.safetensors"
    # an interrupted copy, as a new file: `direct` still maps the old one (truncating a mapped file faults)
    cut = weights.with_name("cut")
    cut.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cut.replace(weights)
    with caplog.at_level(logging.WARNING, logger="tserve.weights"):
        again = import_cache.load_converted(manifest, convert)
    assert convert.calls == 2 and "cannot be read" in caplog.text and "truncated" in caplog.text
    same(again, direct)
    (entry,) = cache.iterdir()
    (entry / "config.json").write_text("{not json")
    assert import_cache.load_converted(manifest, convert) is not None and convert.calls == 3


def test_a_new_converter_gives_a_new_entry_and_drops_the_old_once_unused(tiny_file, manifest, cache, monkeypatch):
    convert = Converter(tiny_file, manifest)
    import_cache.load_converted(manifest, convert)
    (old,) = cache.iterdir()
    monkeypatch.setattr(import_cache, "code_version", lambda: "changed")
    import_cache.load_converted(manifest, convert)
    assert convert.calls == 2 and len(list(cache.iterdir())) == 2  # the old one was used just now: kept
    monkeypatch.setattr(import_cache, "code_version", lambda: "changed again")
    age(old)
    import_cache.load_converted(manifest, convert)
    assert convert.calls == 3 and old not in list(cache.iterdir()) and len(list(cache.iterdir())) == 2


def age(entry):
    """``entry`` last used longer ago than the cache keeps an older entry that may be in use."""
    past = time.time() - import_cache.IN_USE_S - 60
    os.utime(entry, (past, past))


def test_the_key_follows_the_code_it_depends_on():
    key = import_cache.code_version()
    assert len(key) == 64 and key == import_cache.code_version()
    covered = {p.name for part in import_cache.CODE for p in (import_cache.MODEL_ROOT / part).rglob("*.py")}
    assert {"gguf_import.py", "gguf_vocab.py", "checkpoint.py", "layers.py"} <= covered


def test_off_or_unwritable_means_no_cache(tiny_file, manifest, cache, tmp_path, monkeypatch, caplog):
    convert = Converter(tiny_file, manifest)
    monkeypatch.setenv(import_cache.SWITCH_ENV, "off")
    import_cache.load_converted(manifest, convert)
    import_cache.load_converted(manifest, convert)
    assert convert.calls == 2 and not cache.exists()
    monkeypatch.delenv(import_cache.SWITCH_ENV)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TSERVE_WEIGHTS_CACHE", str(blocker))  # a file where the directory should be
    with caplog.at_level(logging.WARNING, logger="tserve.weights"):
        ckpt = import_cache.load_converted(manifest, convert)
    assert ckpt.chat_template == CHATML and "cannot cache converted weights" in caplog.text


def test_int8_copies_are_kept_beside_the_entry(tiny_file, manifest, cache, monkeypatch, caplog):
    from model.quant import int8

    convert = Converter(tiny_file, manifest)
    first = import_cache.load_converted(manifest, convert)
    assert int8.quantize_checkpoint_(first.model, first.tokenizer) > 0
    (entry,) = cache.iterdir()
    (saved,) = entry.glob("int8-*.safetensors")
    calibrations = []
    real = int8.quantize_int8_
    monkeypatch.setattr(int8, "quantize_int8_", lambda *a, **k: calibrations.append(1) or real(*a, **k))
    second = import_cache.load_converted(manifest, convert)
    int8.quantize_checkpoint_(second.model, second.tokenizer)
    assert calibrations == []  # read, not quantized again
    ids = torch.tensor([first.tokenizer.encode(SENTENCES[0])])
    with torch.no_grad(), int8.decode_step_context():
        assert torch.equal(first.model(ids), second.model(ids))
    saved.write_bytes(b"not safetensors")
    third = import_cache.load_converted(manifest, convert)
    with caplog.at_level(logging.WARNING, logger="tserve.weights"):
        int8.quantize_checkpoint_(third.model, third.tokenizer)
    assert calibrations == [1] and "quantizing again" in caplog.text
    with torch.no_grad(), int8.decode_step_context():
        assert torch.equal(first.model(ids), third.model(ids))


# --- a GGUF file given by path: keyed by its identity ------------------------------------------

def test_a_gguf_path_is_cached_and_a_changed_file_misses(tmp_path, cache, monkeypatch):
    from model.formats.sources import load_model

    bpe = train_byte_bpe()
    file = write_llama_gguf(tmp_path / "model.gguf", tiny_llama(seed=1, vocab_size=bpe.get_vocab_size()), bpe,
                            GGUFSpec(qtype=Q.Q4_0, qtypes={"token_embd.weight": Q.Q8_0}))
    first = load_model(file)
    (entry,) = cache.iterdir()
    assert entry.name.startswith("f") and first.path == file
    calls = []  # conversions: the GGUF streamed into a new entry
    real = import_cache.write_gguf_entry
    monkeypatch.setattr(import_cache, "write_gguf_entry", lambda *a: calls.append(1) or real(*a))
    second = load_model(file)
    assert calls == [] and list(cache.iterdir()) == [entry]  # read back, not converted again
    same(second, first)
    monkeypatch.setenv(import_cache.SWITCH_ENV, "off")
    same(load_model(file), first)  # the entry equals a fresh conversion in memory, tensor for tensor
    monkeypatch.delenv(import_cache.SWITCH_ENV)
    write_llama_gguf(file, tiny_llama(seed=2, vocab_size=bpe.get_vocab_size()), bpe)  # rewritten in place
    age(entry)
    third = load_model(file)
    assert calls == [1] and not torch.equal(third.model.embed.tokens.weight, first.model.embed.tokens.weight)
    (newer,) = cache.iterdir()
    assert newer != entry  # the older entry of the same file went
    file.unlink()
    other = write_llama_gguf(tmp_path / "other.gguf", tiny_llama(seed=3, vocab_size=bpe.get_vocab_size()), bpe)
    load_model(other)
    assert [p.name[:16] for p in cache.iterdir()] == [import_cache.entry_dir(other, {}).name[:16]]  # orphan gone


def test_conversion_holds_one_tensor_beyond_the_model(tmp_path):
    """The GGUF import's float copies (numpy, which tracemalloc sees) never exceed the model it
    keeps plus a bounded multiple of its largest tensor: no second copy of the whole model."""
    import tracemalloc

    from model.formats.gguf_import import GGUFFile, gguf_config, gguf_model

    bpe = train_byte_bpe()
    hf = tiny_llama(seed=4, vocab_size=bpe.get_vocab_size(), num_hidden_layers=8, intermediate_size=512)
    file = write_llama_gguf(tmp_path / "deep.gguf", hf, bpe, GGUFSpec(qtype=Q.Q8_0))
    f = GGUFFile(file)  # the metadata parsed (gguf's reader: many small arrays) before we count
    cfg = gguf_config(f)
    gguf_model(f, cfg)  # whatever is imported once per process
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        model = gguf_model(f, cfg)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    tensors = {t.data_ptr(): t for t in model.state_dict().values() if t.is_floating_point()}.values()
    largest = max(t.numel() * 4 for t in tensors)
    total = sum(t.numel() * 4 for t in tensors)
    # Beyond what the import keeps: one tensor's dequantization at a time (gguf's numpy makes a
    # few float temporaries of the tensor's size), never the float copies of every projection.
    assert peak - after <= 8 * largest, (peak - after, largest)
    assert total - (after - before) > 16 * largest  # the projections alone dwarf the bound
