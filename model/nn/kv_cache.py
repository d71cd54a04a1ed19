"""Static, slot-based KV cache for serving.

One preallocated buffer per K and V holds every layer: (layers, slots, nh, max_len + 1, hs).
Each slot holds one sequence; sequences in a batch sit at their own positions, and a
slot is freed (by the scheduler's bookkeeping) and reused without reallocating. The
extra last position is a scratch column: padded rows of a ragged prefill batch write
there, so they can never overwrite a real position of the same slot.

For the encoder-decoder the cache also keeps the cross-attention K/V of each slot's
source, computed once at admission, and the source length used to mask it.

A forward pass sees the cache through a ``CacheView``: each attention layer calls
``k, v = view.update(layer, k, v)`` (gpt-fast style), which writes the new tokens in place
and returns a span of the history whose length comes from a small fixed set of sizes
(powers of two), with a mask for the positions a row may see. Shapes therefore change only
when a sequence crosses a size boundary, which is what a compiled or CUDA-graphed decode
step needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.nn.host_transfer import to_device


@dataclass
class SlotBatch:
    """The slots one forward pass touches, in the forms the cache needs."""

    slots: list[int]
    ids: Tensor  # (B,) long, on the cache device
    index: slice | Tensor  # a slice when the slots are contiguous: reading is then a view, not a copy


MIN_SPAN = 16  # the smallest history span a forward pass reads


def span_bucket(needed: int, limit: int) -> int:
    """The smallest power of two >= ``needed`` (at least MIN_SPAN), capped at ``limit``."""
    span = MIN_SPAN
    while span < needed:
        span *= 2
    return min(span, limit)


class SlotKVCache(nn.Module):
    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_heads: int,
        head_dim: int,
        max_len: int,
        max_src_len: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.n_layers, self.n_slots, self.max_len, self.max_src_len = n_layers, n_slots, max_len, max_src_len
        self.n_heads, self.head_dim = n_heads, head_dim  # K/V heads (fewer than query heads under GQA)
        shape = (n_layers, n_slots, n_heads, max_len + 1, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        positions = torch.arange(max(max_len + 1, max_src_len), device=device)
        self.register_buffer("key_positions", positions, persistent=False)
        self.register_buffer("head_rows", torch.arange(n_heads, device=device), persistent=False)
        if max_src_len:
            cross_shape = (n_layers, n_slots, n_heads, max_src_len, head_dim)
            self.register_buffer("cross_k", torch.zeros(cross_shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer("cross_v", torch.zeros(cross_shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer("src_lengths", torch.zeros(n_slots, dtype=torch.long, device=device),
                                 persistent=False)
        self.src_lengths_host = [0] * n_slots  # host copy, so batch shapes need no device sync

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def batch(self, slots: Sequence[int]) -> SlotBatch:
        slots = [int(s) for s in slots]
        if not slots:
            raise ValueError("empty slot batch")
        bad = [s for s in slots if not 0 <= s < self.n_slots]
        if bad:
            raise IndexError(f"slots {bad} out of range [0, {self.n_slots})")
        ids = to_device(slots, torch.long, self.device)
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        index: slice | Tensor = slice(slots[0], slots[0] + len(slots)) if contiguous else ids
        return SlotBatch(slots, ids, index)

    # --- self-attention history ------------------------------------------------------
    def write(self, layer: int, batch: SlotBatch, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v (B, nh, T, hs) at positions (B, T) of each slot, in place.

        Written as row copies into the buffer flattened to (slots * nh * (max_len + 1), hs):
        an index_put_ with a slice between its index tensors is ~50x slower on CPU.
        """
        _, _, nh, span, hs = self.k.shape
        rows = (batch.ids[:, None, None] * nh + self.head_rows[None, :, None]) * span + positions[:, None, :]
        rows = rows.reshape(-1)  # (B * nh * T,) in the (B, nh, T) order of k and v
        self.k[layer].view(-1, hs).index_copy_(0, rows, k.reshape(-1, hs).to(self.k.dtype))
        self.v[layer].view(-1, hs).index_copy_(0, rows, v.reshape(-1, hs).to(self.v.dtype))

    def read(self, layer: int, batch: SlotBatch, length: int) -> tuple[Tensor, Tensor]:
        """The first ``length`` positions of each slot: 2 x (B, nh, length, hs)."""
        return self.k[layer][batch.index, :, :length], self.v[layer][batch.index, :, :length]

    # --- cross-attention memory (encoder-decoder) ------------------------------------
    def write_cross(self, layer: int, batch: SlotBatch, k: Tensor, v: Tensor) -> None:
        """Store the source's projected memory k, v (B, nh, S, hs) for each slot."""
        s = k.size(2)
        if s > self.max_src_len:
            raise ValueError(f"source length {s} exceeds the cache's max_src_len {self.max_src_len}")
        self.cross_k[layer][batch.ids, :, :s] = k.to(self.cross_k.dtype)
        self.cross_v[layer][batch.ids, :, :s] = v.to(self.cross_v.dtype)

    def set_src_lengths(self, batch: SlotBatch, lengths: Sequence[int]) -> None:
        self.src_lengths[batch.ids] = to_device(lengths, torch.long, self.device)
        for slot, n in zip(batch.slots, lengths):
            self.src_lengths_host[slot] = int(n)

    def read_cross(self, layer: int, batch: SlotBatch, length: int) -> tuple[Tensor, Tensor]:
        return self.cross_k[layer][batch.index, :, :length], self.cross_v[layer][batch.index, :, :length]

    def cross_mask(self, batch: SlotBatch, length: int) -> Tensor:
        """(B, 1, 1, length): True on the real source tokens of each slot."""
        lengths = self.src_lengths[batch.index]
        return (self.key_positions[:length][None, :] < lengths[:, None])[:, None, None, :]

    # --- slot management ---------------------------------------------------------------
    def copy_slots(self, src: Sequence[int], dst: Sequence[int], length: int | None = None) -> None:
        """Copy the history of slots ``src`` into ``dst`` (beam search reorders this way).

        The right-hand side is gathered before it is written, so src and dst may overlap.
        """
        n = self.max_len + 1 if length is None else length
        src_t, dst_t = to_device(src, torch.long, self.device), to_device(dst, torch.long, self.device)
        for buf in (self.k, self.v):
            history = buf[:, :, :, :n]  # (layers, slots, nh, n, hs) view
            history.index_copy_(1, dst_t, history.index_select(1, src_t))

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Move everything slot ``src`` holds (``length`` positions of history, and the
        cross-attention memory) to slot ``dst``. The scheduler moves sequences into freed
        slots below them so a batch's slots stay contiguous and reads stay views."""
        self.copy_slots([src], [dst], length)
        if self.max_src_len:
            n = self.src_lengths_host[src]
            self.cross_k[:, dst, :, :n] = self.cross_k[:, src, :, :n]
            self.cross_v[:, dst, :, :n] = self.cross_v[:, src, :, :n]
            self.src_lengths[dst] = self.src_lengths[src]
            self.src_lengths_host[dst] = n


@dataclass
class CacheView:
    """The cache as one forward pass over ``batch`` sees it; the attention layers call it.

    ``write_positions`` (B, T) is where each new token goes (padding goes to the scratch
    column). ``span`` is how much history ``update`` returns (None: nothing cached yet, so
    the layer attends over the new tokens alone, causally).
    """

    cache: SlotKVCache
    batch: SlotBatch
    write_positions: Tensor
    span: int | None
    cross_len: int = 0
    cross_mask: Tensor | None = None

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.cache.write(layer, self.batch, self.write_positions, k, v)
        if self.span is None:
            return k, v
        keys, values = self.cache.read(layer, self.batch, self.span)  # 2 x (B, nkv, span, hs)
        # A cache kept in a narrower dtype than the model computes in (TSERVE_KV_DTYPE) is read
        # back in the model's dtype; the same dtype is a no-op.
        return keys.to(k.dtype), values.to(v.dtype)

    def update_in_place(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a kernel that reads the slots where they lie (decode, one new token per row):
        write k, v (B, nkv, 1, hs); return the layer's whole cache k, v (slots, nkv, max_len + 1,
        hs), the batch's slot ids (B,) and how many positions each row sees (B,): up to and
        including the token just written, the same positions the decode mask allows."""
        if self.write_positions.size(1) != 1:
            raise ValueError("update_in_place is for one new token per row")
        self.cache.write(layer, self.batch, self.write_positions, k, v)
        return self.cache.k[layer], self.cache.v[layer], self.batch.ids, self.write_positions[:, 0] + 1

    def cross(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
        return (*self.cache.read_cross(layer, self.batch, self.cross_len), self.cross_mask)


class PrefixKVPool(nn.Module):
    """The K/V of cached prompt blocks (the prefix cache), apart from the slots:
    (layers, blocks, nh, block_len, hs) for each of K and V.

    Blocks are copied into a slot when a request whose prompt starts with them is admitted,
    and copied out of a slot once a prompt has written them; which block holds what is the
    scheduler's business (``model.engine.prefix_cache.PrefixIndex``). The buffers are
    allocated empty: a block is only ever read after it was written, and on the host the
    pages of blocks never written are never touched.
    """

    def __init__(self, n_layers: int, n_blocks: int, n_heads: int, head_dim: int, block_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.n_blocks, self.block_len = n_blocks, block_len
        shape = (n_layers, n_blocks, n_heads, block_len, head_dim)
        self.register_buffer("k", torch.empty(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.empty(shape, dtype=dtype, device=device), persistent=False)

    @staticmethod
    def block_bytes(n_layers: int, n_heads: int, head_dim: int, block_len: int, dtype: torch.dtype) -> int:
        return 2 * n_layers * n_heads * block_len * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def load(self, cache: SlotKVCache, blocks: Sequence[int], slot: int) -> None:
        """Copy ``blocks`` (in order) into positions 0 .. len(blocks) * block_len of ``slot``."""
        ids = to_device(blocks, torch.long, self.k.device)
        n = len(blocks) * self.block_len
        for pool, buf in ((self.k, cache.k), (self.v, cache.v)):
            run = pool.index_select(1, ids)  # (layers, nb, nh, block_len, hs)
            layers, nb, nh, bl, hs = run.shape
            buf[:, slot, :, :n] = run.transpose(1, 2).reshape(layers, nh, nb * bl, hs)

    def store(self, cache: SlotKVCache, slot: int, first: int, blocks: Sequence[int]) -> None:
        """Copy the prompt blocks ``first``, ``first + 1``, ... of ``slot`` into pool ``blocks``."""
        ids = to_device(blocks, torch.long, self.k.device)
        start, end = first * self.block_len, (first + len(blocks)) * self.block_len
        for pool, buf in ((self.k, cache.k), (self.v, cache.v)):
            span = buf[:, slot, :, start:end]  # (layers, nh, nb * block_len, hs)
            layers, nh, _, hs = span.shape
            run = span.reshape(layers, nh, len(blocks), self.block_len, hs).transpose(1, 2)
            pool.index_copy_(1, ids, run.to(pool.dtype))  # (layers, nb, nh, block_len, hs)
