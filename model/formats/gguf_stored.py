"""``TSERVE_GGUF_WEIGHTS=stored``: an imported GGUF model's projections read the file's own blocks
(``model.quant.kquant.KQuantLinear`` over views of the memory-mapped file) in place of float
weights that later become int8. A projection is swapped only where every tensor it is made of
has a type the block kernels read; the others (float tensors, types outside kquant.TYPES) stay as
imported. Rows are taken as the import takes them (llama's q / k rows put back in rotate-half
order, which copies those two tensors' bytes; Phi-3's fused up split in halves, a view)."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch
from torch import Tensor, nn

from model.decode import native
from model.quant import kquant
from model.quant.kquant import KQuantLinear

log = logging.getLogger(__name__)


def _raw(f, name: str) -> tuple[Tensor, int] | None:
    """The tensor's bytes as stored, (rows, row bytes) uint8 (no copy), and its type; None where
    the block kernels do not read its type."""
    info = f.tensors[name]
    code = int(info.tensor_type)
    if code not in kquant.TYPES:
        return None
    rows = int(np.prod([int(s) for s in info.shape.tolist()[1:]]))
    with warnings.catch_warnings():  # the reader's map is read-only, and so are these views
        warnings.filterwarnings("ignore", message=".*not writable.*")
        raw = torch.from_numpy(np.asarray(info.data).reshape(rows, -1))
    f.used.add(name)
    return raw, code


def _rope_rows(raw: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's interleaved q / k rows back in rotate-half order (gguf_import.unpermute_rope_rows)."""
    rows, width = raw.shape
    return raw.reshape(n_heads, rows // n_heads // 2, 2, width).transpose(1, 2).reshape(rows, width).contiguous()


def _swap(parent: nn.Module, attr: str, parts: list[tuple[Tensor, int] | None]) -> int:
    old = getattr(parent, attr)
    if any(p is None for p in parts):
        return 0
    layer = KQuantLinear(parts, old.in_features, old.bias)  # type: ignore[arg-type]
    if layer.out_features != old.out_features:
        raise ValueError(f"{attr}: the stored tensors have {layer.out_features} outputs, the model {old.out_features}")
    setattr(parent, attr, layer)
    return 1


def stored_projections_(model: nn.Module, f, cfg) -> int:
    """Swap the projections of an imported GGUF model (``f``: its ``GGUFFile``) for ones over the
    file's blocks, in place; returns how many were swapped."""
    arch = f.get("general.architecture")
    count = 0
    for i, layer in enumerate(model.decoder_layers):
        blk, attn, ffn = f"blk.{i}", layer.self_attn, layer.ffn
        if arch == "phi3":
            qkv = [_raw(f, f"{blk}.attn_qkv.weight")]
        else:
            qkv = [_raw(f, f"{blk}.attn_{x}.weight") for x in "qkv"]
            if arch == "llama" and all(qkv):
                qkv[0] = (_rope_rows(qkv[0][0], cfg.n_heads), qkv[0][1])
                qkv[1] = (_rope_rows(qkv[1][0], cfg.kv_heads), qkv[1][1])
        count += _swap(attn, "qkv_proj", qkv)
        count += _swap(attn, "out_proj", [_raw(f, f"{blk}.attn_output.weight")])
        if arch == "phi3":  # ffn_up holds the gate rows, then the up rows
            up = _raw(f, f"{blk}.ffn_up.weight")
            half = None if up is None else up[0].shape[0] // 2
            count += _swap(ffn, "gate", [None if up is None else (up[0][:half], up[1])])
            count += _swap(ffn, "up", [None if up is None else (up[0][half:], up[1])])
        else:
            count += _swap(ffn, "gate", [_raw(f, f"{blk}.ffn_gate.weight")])
            count += _swap(ffn, "up", [_raw(f, f"{blk}.ffn_up.weight")])
        count += _swap(ffn, "down", [_raw(f, f"{blk}.ffn_down.weight")])
    if not cfg.tie_word_embeddings:
        count += _swap(model.lm_head, "proj", [_raw(f, "output.weight")])
    if count:
        try:
            native.build()  # the block kernels; without them each call dequantizes its weights
        except RuntimeError as exc:
            log.warning("%s; the stored GGUF blocks are dequantized on each call", exc)
    return count
