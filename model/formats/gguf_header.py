"""A GGUF file's header read fast: its scalar metadata and its tensors' names, shapes and types,
without the data.

``gguf.GGUFReader`` parses every array of the metadata into numpy views, one per element. A
tokenizer's arrays (Gemma 3's 262,144 tokens, their scores and types) took it ~12 s per file
here, and the service read the header twice per load (the memory estimate and the model card)
before it read any weight: half of a cached start-up. This reader walks the same layout with
``struct`` and keeps arrays only as (item type, count), or (``arrays=True``, what the import's
``gguf_import.GGUFFile`` asks) as lists, strings decoded in one loop and numbers through one
``numpy.frombuffer`` each: the 1.5B Qwen's 151,936 tokens and merges in well under a second,
where gguf's reader took ~30 s of every start.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64, key count
u64; each key a string (u64 length, bytes), a value type u32 and the value (an array: item type
u32, count u64, the items); then each tensor's name, dimension count u32, dimensions u64 each
(innermost first), ggml type u32 and data offset u64.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# value type -> struct format of a scalar of that type (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """Not a GGUF file this reader understands (the message says where it stopped)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as stored: innermost dimension first
    ggml_type: int
    offset: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ArrayInfo:
    item_type: int
    count: int


@dataclass
class GGUFHeader:
    version: int
    fields: dict[str, object] = field(default_factory=dict)  # scalars and strings; arrays as ArrayInfo
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0  # where the tensors' data begins (the header's end, aligned)


_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


class _Cursor:
    def __init__(self, data, path: Path, arrays: bool = False):
        self.data, self.at, self.path, self.arrays = data, 0, path, arrays

    def take(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.at)
        except struct.error:
            raise GGUFHeaderError(f"{self.path}: the header ends early (at byte {self.at})") from None
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.data):
            raise GGUFHeaderError(f"{self.path}: a string of {n} bytes runs past the end (at byte {self.at})")
        raw = bytes(self.data[self.at:self.at + n])
        self.at += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        data, at, end = self.data, self.at, len(self.data)
        for _ in range(count):
            if at + 8 > end:
                raise GGUFHeaderError(f"{self.path}: an array of strings runs past the end")
            (n,) = struct.unpack_from("<Q", data, at)
            at += 8 + n
        if at > end:
            raise GGUFHeaderError(f"{self.path}: an array of strings runs past the end")
        self.at = at

    def strings(self, count: int) -> list[str]:
        data, at, end, out = self.data, self.at, len(self.data), []
        for _ in range(count):
            if at + 8 > end:
                raise GGUFHeaderError(f"{self.path}: an array of strings runs past the end")
            (n,) = struct.unpack_from("<Q", data, at)
            if at + 8 + n > end:
                raise GGUFHeaderError(f"{self.path}: an array of strings runs past the end")
            out.append(bytes(data[at + 8:at + 8 + n]).decode("utf-8", errors="replace"))
            at += 8 + n
        self.at = at
        return out

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if self.arrays and item == STRING:
                return self.strings(count)
            if self.arrays and item in _SCALARS:
                size = struct.calcsize(_SCALARS[item]) * count
                if self.at + size > len(self.data):
                    raise GGUFHeaderError(f"{self.path}: an array runs past the end")
                values = np.frombuffer(self.data, dtype=_NUMPY[item], count=count, offset=self.at).tolist()
                self.at += size
                return values
            if self.arrays:
                return [self.value(item) for _ in range(count)]
            if item == STRING:
                self.skip_strings(count)
            elif item in _SCALARS:
                self.at += struct.calcsize(_SCALARS[item]) * count
            else:  # arrays of arrays: walked one by one (none in the files we serve)
                for _ in range(count):
                    self.value(item)
            if self.at > len(self.data):
                raise GGUFHeaderError(f"{self.path}: an array runs past the end")
            return ArrayInfo(item, count)
        raise GGUFHeaderError(f"{self.path}: unknown value type {kind} at byte {self.at - 4}")


def read_header(path: str | Path, arrays: bool = False) -> GGUFHeader:
    """The header of the GGUF file at ``path`` (``arrays``: array values as lists, else
    ``ArrayInfo``); raises GGUFHeaderError (or OSError)."""
    path = Path(path)
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cur = _Cursor(data, path, arrays)
        if bytes(data[:4]) != b"GGUF":
            raise GGUFHeaderError(f"{path}: no GGUF magic")
        cur.at = 4
        version = cur.take("<I")
        if version not in (2, 3):  # a big-endian file reads as a huge version; v1 had 32-bit counts
            raise GGUFHeaderError(f"{path}: GGUF version {version} (this reader knows 2 and 3, little-endian)")
        n_tensors, n_keys = cur.take("<Q"), cur.take("<Q")
        header = GGUFHeader(version)
        for _ in range(n_keys):
            key = cur.string()
            header.fields[key] = cur.value(cur.take("<I"))
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            header.tensors.append(TensorInfo(name, dims, cur.take("<I"), cur.take("<Q")))
        align = header.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFHeaderError(f"{path}: general.alignment is {align!r}; expected a power of two")
        header.data_start = cur.at + (-cur.at % align)
        return header
