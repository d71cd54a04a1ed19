"""What a loaded model costs in memory, and giving that memory back to the operating system.

Weights are counted from the tensors the model holds (parameters, buffers, the prepacked and
int8 copies that ``model.decode.prepare`` adds), each storage once. KV caches are counted by
the cache objects themselves (``nbytes``): the paged cache's block pool, the prefix cache's
blocks among them.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import logging
import os
from pathlib import Path

import torch
from torch import nn

from model.formats.gguf_header import GGUFHeaderError, read_header
from model.formats.gguf_import import is_gguf_file
from model.formats.manifest import ManifestError, is_manifest_dir, locate, read_manifest
from model.quant.int8 import DecodeInt8Linear
from model.quant.kquant import KQuantLinear

log = logging.getLogger("tserve.memory")


def _tensor_bytes(t: torch.Tensor) -> int:
    if t.layout != torch.strided or t.is_mkldnn:  # opaque layouts (oneDNN prepacked weights) have no storage
        return t.numel() * t.element_size()
    return t.untyped_storage().nbytes()


def _storage_key(t: torch.Tensor) -> tuple:
    if t.layout != torch.strided or t.is_mkldnn:
        return ("opaque", id(t))
    return ("storage", t.device.type, t.untyped_storage().data_ptr())


def weights_bytes(model: nn.Module) -> int:
    """Bytes of every tensor ``model`` holds, shared storages counted once (tied embeddings)."""
    seen: dict[tuple, int] = {}

    def add(t: torch.Tensor) -> None:
        seen.setdefault(_storage_key(t), _tensor_bytes(t))

    for module in model.modules():
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if t is not None:
                add(t)
        for value in vars(module).values():  # tensors kept as plain attributes (prepacked copies)
            if isinstance(value, torch.Tensor):
                add(value)
        if isinstance(module, KQuantLinear):  # GGUF blocks as stored (views of the mapped file)
            for part in module.parts:
                add(part.raw)
        if isinstance(module, DecodeInt8Linear):  # its int8 copy: sizes known without unpacking fbgemm's
            # (unpacking took ~2 s per call for Gemma 3); the bias is the float layer's, where kept
            q, bias = module.quantized, None if module.dense is None else module.dense.bias
            seen[("packed", id(q))] = q.out_features * q.in_features + (0 if bias is None else bias.numel() * 4)
        packed = getattr(module, "_packed_params", None)  # a dynamic int8 Linear: int8 weight + float bias
        if packed is not None and hasattr(module, "_weight_bias") and ("packed", id(module)) not in seen:
            weight, bias = module._weight_bias()
            seen[("packed", id(module))] = weight.numel() * weight.element_size() + (
                0 if bias is None else bias.numel() * bias.element_size())
    return sum(seen.values())


# release_memory freezes what the collector keeps; at exit it is unfrozen again, so that the
# interpreter's last collection still finalizes it (native libraries such as xgrammar's report
# objects they never saw destroyed). Unfreezing with nothing frozen does nothing.
atexit.register(gc.unfreeze)


def release_memory() -> bool:
    """Collect garbage, then ask glibc to hand freed heap pages back (``malloc_trim``): without it
    the arena keeps most of an unloaded model's pages and the process's RSS does not drop
    (measured in docs/benchmarks.md). Returns whether ``malloc_trim`` ran (glibc only).

    What survives the collection is then frozen (``gc.freeze``): the loaded models' modules, the
    tokenizers' vocabularies, the app. The collector's full passes walked all of it again while
    requests ran (1-2.5 % of a 1.5B decode step's time, in-process). Each call unfreezes first,
    so the collection still finds an unloaded model's cycles; objects freed by their reference
    counts go as before, frozen or not (and at exit all is unfrozen: above)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def rss_bytes() -> int:
    """The process's resident set size now (Linux /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def source_weight_bytes(path: Path, dtype: torch.dtype, rescorer: bool = True) -> int:
    """Bytes a model's weights take once loaded at ``dtype``, read from the source without loading
    it: a GGUF file's tensors dequantized (element count x ``dtype``'s size), else the size of the
    safetensors files (stored at the dtype they load in); with the fill-mask rescorer's causal LM
    where the manifest names one (``rescorer``)."""
    try:
        manifest = read_manifest(path) if is_manifest_dir(path) else None
        file = locate(manifest) if manifest is not None else path
    except ManifestError:
        return 0
    if rescorer and manifest is not None and manifest.rescore is not None:  # the causal LM a fill-mask model loads too
        return source_weight_bytes(path, dtype, rescorer=False) + source_weight_bytes(manifest.rescore.model, dtype)
    if file.is_file() and is_gguf_file(file):
        size = torch.empty((), dtype=dtype).element_size()
        try:
            return sum(t.n_elements * size for t in read_header(file).tensors)
        except (OSError, GGUFHeaderError) as exc:  # the load itself will say what is wrong
            log.warning("cannot read the GGUF header of %s: %s", file, exc)
            return 0
    folder = file if file.is_dir() else file.parent
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
