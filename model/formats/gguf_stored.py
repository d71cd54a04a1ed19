"""The blocks of a GGUF file read as stored (``TSERVE_GGUF_WEIGHTS=stored``; the import,
``gguf_import.gguf_model``, asks here for each tensor): a tensor's bytes as a uint8 view of the
memory-mapped file, for ``model.quant.kquant.KQuantLinear`` (projections) and ``StoredEmbedding``
(the token table, and a tied output head over the same blocks). Only types the block kernels read
(``kquant.TYPES``); the others are dequantized to float by the import as before."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from model.quant import kquant
from model.quant.kquant import KQuantLinear, StoredEmbedding

if TYPE_CHECKING:
    from model.config import ModelConfig


def stored_rows(f, tensor: str, select: Tensor | None = None) -> tuple[Tensor, int] | None:
    """Rows of ``tensor`` of ``f`` (a ``gguf_import.GGUFFile``), all or those ``select`` lists, as
    the file stores them: (rows, row bytes) uint8 and their ggml type; None where the tensor is
    missing or of a type the block kernels do not read. All rows, or one run of them, are a view
    of the mapped file; another selection (llama's q / k rows) is a copy of those bytes."""
    info = f.tensors.get(tensor)
    if info is None or int(info.tensor_type) not in kquant.TYPES:
        return None
    rows = int(np.prod([int(s) for s in info.shape.tolist()[1:]]))
    with warnings.catch_warnings():  # the reader's map is read-only, and so are these views
        warnings.filterwarnings("ignore", message=".*not writable.*")
        raw = torch.from_numpy(np.asarray(info.data).reshape(rows, -1))
    sel = select
    if sel is not None:
        first = int(sel[0]) if sel.numel() else 0
        if sel.numel() and torch.equal(sel, torch.arange(first, first + sel.numel())):
            raw = raw[first:first + sel.numel()]
        else:
            raw = raw[sel].contiguous()
    return raw, int(info.tensor_type)


def stored_embedding_(model: nn.Module, embedding: tuple[Tensor, int], cfg: ModelConfig) -> None:
    """Gives ``model`` (built on the meta device) the token table as ``embedding``'s blocks
    (``stored_rows`` of token_embd), and a tied head as a projection over the same blocks."""
    raw, code = embedding
    model.embed.tokens = StoredEmbedding(raw, code, cfg.d_model)
    if cfg.tie_word_embeddings:
        model.lm_head.proj = KQuantLinear([embedding], cfg.d_model)
