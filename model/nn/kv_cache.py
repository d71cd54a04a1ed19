"""The paged KV cache: one pool of fixed-size K/V blocks per model, a block table per sequence.

Storage. K and V are each one buffer (layers, kv heads, blocks, BLOCK_LEN, head dim). A block
holds BLOCK_LEN consecutive positions of one sequence, in every layer and head; heads outermost,
so a sequence's blocks, allocated in order, lie end to end for each head as a slot's history did
(the decode step reads them in one stream); block 0 is the null
block (never handed out, kept zero): the padding of a ragged batch is written there, and the
table entries of positions a sequence does not (or no longer) hold point there.

Sequences. A forward pass addresses sequences by *row* ("slot", the name the engine keeps):
a row has a block table (``tables[row]``, on the host) that maps position p to block
``tables[row, p // BLOCK_LEN]``, offset ``p % BLOCK_LEN``. Rows are a batch cap, not memory:
a row that holds 20 tokens holds two blocks whatever the model's context length.

Sharing. Blocks are reference counted (``BlockRefs``; the engine's ``BlockPool``,
model.engine.block_pool, adds the prefix cache's names). A block may sit in several tables at
once: a prompt prefix found in the prefix cache, the common history of beam-search
hypotheses. Only full blocks are ever shared by the prefix cache, so nobody writes a shared
block; a beam fork shares its last, partial block too, and the engine copies it before the
first write (copy on write, ``PagedKVCache.private``). A block whose references drop to zero
goes back to the free list, unless the prefix cache names it by a hash: then it stays
readable, evictable least recently used first, until a new allocation needs it.

Reading. Each attention layer calls ``k, v = view.update(layer, k, v)`` (gpt-fast style): the
new tokens are written through the table, and the Python path gets a span of history (whole
blocks, up to the furthest row's end), gathered block by block, with a mask for the positions
a row may see. The decode steps that read blocks in place (the C++ step,
the Triton kernel) get the pool and the tables (``update_in_place``).

For the encoder-decoder each row also reads the cross-attention K/V of its source, computed
once at admission, and the source length used to mask it (per row, not paged: a source is
short and read whole at every step). The K/V lie in one memory row per source: a beam
search's rows all read the row of its first beam (``cross_rows``), so a step reads each
source's memory once per beam width fewer times than with a copy per beam (at 4 beams x 32
sources the copies no longer fit the caches, and cross-attention waited on memory).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.nn.host_transfer import to_device

BLOCK_LEN = 16  # positions per block: the unit of allocation, sharing and prefix matching
NULL_BLOCK = 0

MIN_SPAN = 16  # the smallest history span a forward pass reads


def span_bucket(needed: int, limit: int) -> int:
    """The smallest power of two >= ``needed`` (at least MIN_SPAN), capped at ``limit``."""
    span = MIN_SPAN
    while span < needed:
        span *= 2
    return min(span, limit)


def blocks_for(positions: int, block_len: int = BLOCK_LEN) -> int:
    return -(-positions // block_len)


class BlockRefs:
    """Reference counts and the free list of a pool's blocks: what the block tables need to
    share and give back blocks. Never touches a tensor. The engine's ``BlockPool``
    (model.engine.block_pool) adds the prefix cache's names and their eviction; a cache used
    alone (``new_cache`` in a notebook, the fill-mask rescorer) gets this one."""

    def __init__(self, n_blocks: int):
        if n_blocks < 2:
            raise ValueError(f"a KV block pool needs at least 2 blocks (one is the null block), got {n_blocks}")
        self.n_blocks = n_blocks
        self.refs = [0] * n_blocks
        self.free = list(range(n_blocks - 1, 0, -1))  # pop() hands out the lowest block first
        self.fresh: list[int] = []  # handed out for the first time: zeroed before they are read
        self._highest = NULL_BLOCK  # the highest block ever handed out (never-used ones leave `free` in order)

    @property
    def available(self) -> int:
        """Blocks an allocation can get now."""
        return len(self.free)

    @property
    def used(self) -> int:
        """Blocks some sequence references."""
        return self.n_blocks - 1 - self.available

    def allocate(self) -> int | None:
        block = self._take()
        if block is None:
            return None
        self.refs[block] = 1
        return block

    def _take(self) -> int | None:
        """An unreferenced block to hand out, or None."""
        if not self.free:
            return None
        block = self.free.pop()
        if block > self._highest:  # its first use
            self._highest = block
            self.fresh.append(block)
        return block

    def incref(self, block: int) -> None:
        if block != NULL_BLOCK:
            self.refs[block] += 1

    def decref(self, block: int) -> None:
        if block == NULL_BLOCK:
            return
        self.refs[block] -= 1
        if self.refs[block] < 0:
            raise RuntimeError(f"KV block {block} released more often than it was taken")
        if self.refs[block] == 0:
            self._unreferenced(block)

    def _unreferenced(self, block: int) -> None:
        self.free.append(block)


@dataclass
class SlotBatch:
    """The rows one forward pass touches, in the forms the cache needs."""

    slots: list[int]
    ids: Tensor  # (B,) long, on the cache device
    index: slice | Tensor  # a slice when the rows are contiguous: per-row reads are then views


class PagedKVCache(nn.Module):
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
        n_blocks: int | None = None,
        block_len: int = BLOCK_LEN,
        pool: BlockRefs | None = None,
    ):
        """``max_len``: positions one sequence may hold (its context); ``n_blocks``: the pool,
        the null block included (default: every row at ``max_len``, nothing ever waits).
        ``pool``: the blocks' bookkeeping, fresh, sized by ``n_blocks`` when both are given (the
        engine passes its ``BlockPool``); default plain reference counts (``BlockRefs``)."""
        super().__init__()
        self.n_layers, self.n_slots, self.max_len, self.max_src_len = n_layers, n_slots, max_len, max_src_len
        self.n_heads, self.head_dim, self.block_len = n_heads, head_dim, block_len  # K/V heads
        self.max_blocks = blocks_for(max_len, block_len)  # table width: blocks of one full sequence
        if pool is not None:
            if n_blocks is not None and n_blocks != pool.n_blocks:
                raise ValueError(f"n_blocks {n_blocks} but the pool has {pool.n_blocks}")
            n_blocks = pool.n_blocks
        n_blocks = n_blocks if n_blocks is not None else 1 + n_slots * self.max_blocks
        shape = (n_layers, n_heads, n_blocks, block_len, head_dim)
        # Allocated empty: the host touches a page when a block is first used (``pool.fresh``).
        self.register_buffer("k", torch.empty(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.empty(shape, dtype=dtype, device=device), persistent=False)
        self.pool = pool if pool is not None else BlockRefs(n_blocks)
        self.pool.fresh.append(NULL_BLOCK)
        self.tables = torch.zeros((n_slots, self.max_blocks), dtype=torch.long)  # on the host
        self.rows: list[list[int]] = [[] for _ in range(n_slots)]  # the same, as lists (0: released)
        positions = torch.arange(max(max_len, max_src_len, block_len), device=device)
        self.register_buffer("key_positions", positions, persistent=False)
        self.register_buffer("head_rows", torch.arange(n_heads, device=device), persistent=False)
        if max_src_len:
            cross_shape = (n_layers, n_slots, n_heads, max_src_len, head_dim)
            self.register_buffer("cross_k", torch.zeros(cross_shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer("cross_v", torch.zeros(cross_shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer("src_lengths", torch.zeros(n_slots, dtype=torch.long, device=device),
                                 persistent=False)
            # the memory row each row reads (its own, or its beam group's first row)
            self.register_buffer("cross_rows", torch.arange(n_slots, device=device), persistent=False)
        self.src_lengths_host = [0] * n_slots  # host copy, so batch shapes need no device sync
        self.cross_rows_host = list(range(n_slots))

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def n_blocks(self) -> int:
        return self.pool.n_blocks

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # --- block tables ----------------------------------------------------------------------
    def held(self, slot: int) -> int:
        """Positions the row's blocks cover."""
        return len(self.rows[slot]) * self.block_len

    def ensure(self, slot: int, length: int) -> bool:
        """Give ``slot`` blocks for positions 0 .. length - 1; False when the pool ran out
        (the blocks it did get stay with the row)."""
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the KV cache's max_len {self.max_len}")
        row = self.rows[slot]
        while len(row) * self.block_len < length:
            block = self.pool.allocate()
            if block is None:
                return False
            self.tables[slot, len(row)] = block
            row.append(block)
        return True

    def release(self, slot: int) -> None:
        """Drop the row's references, last block first (a cached chain's root stays longest)."""
        for block in reversed(self.rows[slot]):
            self.pool.decref(block)
        self.rows[slot] = []
        self.tables[slot].zero_()

    def adopt(self, slot: int, blocks: Sequence[int]) -> None:
        """Start an empty row with shared blocks (a cached prefix), read in place."""
        if self.rows[slot]:
            raise ValueError(f"row {slot} is not empty")
        for i, block in enumerate(blocks):
            self.pool.incref(block)
            self.tables[slot, i] = block
        self.rows[slot] = list(blocks)

    def fork(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Rows ``dst`` take the tables of rows ``src`` by reference (beam search keeps some
        hypotheses twice); src and dst may overlap: every source table is read first."""
        tables = [list(self.rows[s]) for s in src]
        for table in tables:
            for block in table:
                self.pool.incref(block)
        for d in dst:
            self.release(d)
        for d, table in zip(dst, tables):
            self.rows[d] = table
            self.tables[d, : len(table)] = torch.as_tensor(table, dtype=torch.long)

    def private(self, slot: int, position: int) -> tuple[int, int] | None | bool:
        """Make the block holding ``position`` of ``slot`` the row's own before it is written:
        None when it already is; (shared block, new block) to copy when it was shared (copy on
        write); False when the pool has no block for the copy."""
        i = position // self.block_len
        row = self.rows[slot]
        if i >= len(row) or self.pool.refs[row[i]] <= 1:
            return None
        block = self.pool.allocate()
        if block is None:
            return False
        old = row[i]
        self.pool.decref(old)
        row[i] = block
        self.tables[slot, i] = block
        return old, block

    def drop_before(self, slot: int, position: int) -> int:
        """Release the row's blocks that hold only positions before ``position`` (out of every
        layer's sliding window); their table entries point to the null block. Returns how many."""
        row, n = self.rows[slot], 0
        for i in range(min(position // self.block_len, len(row))):
            if row[i] != NULL_BLOCK:
                self.pool.decref(row[i])
                row[i] = NULL_BLOCK
                self.tables[slot, i] = NULL_BLOCK
                n += 1
        return n

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the K/V of block ``src`` into block ``dst`` for each pair (copy on write)."""
        if not pairs:
            return
        src = to_device([s for s, _ in pairs], torch.long, self.device)
        dst = to_device([d for _, d in pairs], torch.long, self.device)
        for buf in (self.k, self.v):
            buf.index_copy_(2, dst, buf.index_select(2, src))

    def zero_fresh(self) -> None:
        """Zero the blocks handed out for the first time: the Python path reads whole spans
        (masked), and a never-written page may hold any bits, NaN among them."""
        if self.pool.fresh:
            ids = to_device(self.pool.fresh, torch.long, self.device)
            self.pool.fresh = []
            for buf in (self.k, self.v):
                buf.index_fill_(2, ids, 0)

    def batch(self, slots: Sequence[int]) -> SlotBatch:
        slots = [int(s) for s in slots]
        if not slots:
            raise ValueError("empty slot batch")
        bad = [s for s in slots if not 0 <= s < self.n_slots]
        if bad:
            raise IndexError(f"slots {bad} out of range [0, {self.n_slots})")
        self.zero_fresh()
        ids = to_device(slots, torch.long, self.device)
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        index: slice | Tensor = slice(slots[0], slots[0] + len(slots)) if contiguous else ids
        return SlotBatch(slots, ids, index)

    def block_tables(self, batch: SlotBatch, positions: int) -> Tensor:
        """(B, blocks covering ``positions``) long, on the cache's device."""
        n = min(blocks_for(positions, self.block_len), self.max_blocks)
        rows = self.tables[batch.index] if isinstance(batch.index, slice) else self.tables[batch.slots]
        return rows[:, :n].to(self.device, non_blocking=True)

    # --- self-attention history ------------------------------------------------------
    def write(self, layer: int, tables: Tensor, positions: Tensor, real: Tensor | None, k: Tensor, v: Tensor) -> None:
        """Store k, v (B, nh, T, hs) at positions (B, T) through the rows' ``tables``; where
        ``real`` (B, T) is False (padding) into the null block. Row copies into the pool
        flattened to (nh * blocks * block_len, hs): an index_put_ with a slice between its index
        tensors is ~50x slower on CPU."""
        bl, hs = self.block_len, self.head_dim
        blocks = tables.gather(1, (positions // bl).clamp(max=tables.size(1) - 1))  # (B, T)
        offsets = positions % bl
        if real is not None:
            blocks = torch.where(real, blocks, NULL_BLOCK)
            offsets = torch.where(real, offsets, 0)
        rows = (self.head_rows[None, :, None] * self.n_blocks + blocks[:, None, :]) * bl + offsets[:, None, :]
        rows = rows.reshape(-1)  # (B * nh * T,) in the (B, nh, T) order of k and v
        self.k[layer].view(-1, hs).index_copy_(0, rows, k.reshape(-1, hs).to(self.k.dtype))
        self.v[layer].view(-1, hs).index_copy_(0, rows, v.reshape(-1, hs).to(self.v.dtype))

    def read(self, layer: int, tables: Tensor, length: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The first ``length`` positions of each row, gathered from its blocks, in ``dtype``
        (default the cache's): 2 x (B, nh, length, hs). One gather, then one strided copy that
        also converts."""
        n = blocks_for(length, self.block_len)
        ids = tables[:, :n]
        out = []
        for buf in (self.k, self.v):
            b = ids.size(0)
            pool = buf[layer]  # (nh, blocks, bl, hs)
            nh, _, bl, hs = pool.shape
            run = pool.index_select(1, ids.reshape(-1)).view(nh, b, n, bl, hs)  # a row copy per block
            dst = torch.empty((b, nh, n * bl, hs), dtype=dtype or buf.dtype, device=buf.device)
            dst.view(b, nh, n, bl, hs).copy_(run.transpose(0, 1))
            out.append(dst if n * bl == length else dst[:, :, :length])
        return out[0], out[1]

    # --- cross-attention memory (encoder-decoder) ------------------------------------
    def write_cross(self, layer: int, batch: SlotBatch, k: Tensor, v: Tensor) -> None:
        """Store the source's projected memory k, v (B, nh, S, hs) for each row."""
        s = k.size(2)
        if s > self.max_src_len:
            raise ValueError(f"source length {s} exceeds the cache's max_src_len {self.max_src_len}")
        self.cross_k[layer][batch.ids, :, :s] = k.to(self.cross_k.dtype)
        self.cross_v[layer][batch.ids, :, :s] = v.to(self.cross_v.dtype)

    def set_src_lengths(self, batch: SlotBatch, lengths: Sequence[int]) -> None:
        self.src_lengths[batch.ids] = to_device(lengths, torch.long, self.device)
        for slot, n in zip(batch.slots, lengths):
            self.src_lengths_host[slot] = int(n)

    def set_cross_rows(self, batch: SlotBatch, rows: Sequence[int]) -> None:
        """Row ``batch.slots[i]`` reads the memory written in row ``rows[i]`` (a beam's first row)."""
        self.cross_rows[batch.ids] = to_device(rows, torch.long, self.device)
        for slot, row in zip(batch.slots, rows):
            self.cross_rows_host[slot] = int(row)

    def memory_rows(self, batch: SlotBatch) -> slice | Tensor:
        """Where ``batch``'s rows read their memory: ``batch.index`` where each reads its own row."""
        if all(self.cross_rows_host[s] == s for s in batch.slots):
            return batch.index
        return self.cross_rows[batch.ids]

    def read_cross(self, layer: int, rows: slice | Tensor, length: int) -> tuple[Tensor, Tensor]:
        """The memory rows ``rows`` (``memory_rows``) of one layer, their first ``length`` positions."""
        return self.cross_k[layer][rows, :, :length], self.cross_v[layer][rows, :, :length]

    def cross_mask(self, batch: SlotBatch, length: int) -> Tensor:
        """(B, 1, 1, length): True on the real source tokens of each row."""
        lengths = self.src_lengths[batch.index]
        return (self.key_positions[:length][None, :] < lengths[:, None])[:, None, None, :]

    # --- rows ---------------------------------------------------------------------------
    def move_table(self, src: int, dst: int) -> None:
        """Move row ``src``'s block table to the empty row ``dst`` (host bookkeeping; no K/V
        moves). The scheduler keeps a batch's rows contiguous so per-row reads stay views."""
        if self.rows[dst]:
            raise ValueError(f"row {dst} is not empty")
        self.rows[dst], self.rows[src] = self.rows[src], []
        self.tables[dst] = self.tables[src]
        self.tables[src].zero_()

    def move_cross(self, src: int, dst: int) -> None:
        """Move row ``src``'s cross-attention memory to row ``dst`` (encoder-decoder): where
        ``src`` holds its source's memory, the memory moves and every row reading it follows;
        where it reads another row's, ``dst`` reads that row's."""
        if self.max_src_len:
            n, owner = self.src_lengths_host[src], self.cross_rows_host[src]
            if owner == src:
                self.cross_k[:, dst, :, :n] = self.cross_k[:, src, :, :n]
                self.cross_v[:, dst, :, :n] = self.cross_v[:, src, :, :n]
                owner = dst
                readers = [x for x, row in enumerate(self.cross_rows_host) if row == src]
            else:
                readers = []
            moved = {x: owner for x in (*readers, dst)} | {src: src}
            for x, row in moved.items():
                self.cross_rows_host[x] = row
            self.cross_rows[to_device(list(moved), torch.long, self.device)] = to_device(
                list(moved.values()), torch.long, self.device)  # one write, not one per row
            self.src_lengths[dst] = self.src_lengths[src]
            self.src_lengths_host[dst] = n


@dataclass
class CacheView:
    """The cache as one forward pass over ``batch`` sees it; the attention layers call it.

    ``positions`` (B, T) is where each new token goes, ``real`` (B, T) which are tokens, not
    padding (None: all are). ``span`` is how much history ``update`` returns (None: nothing
    cached yet, so the layer attends over the new tokens alone, causally). ``tables``: the
    rows' block tables, wide enough for the span and every position written.
    """

    cache: PagedKVCache
    batch: SlotBatch
    positions: Tensor
    real: Tensor | None
    tables: Tensor
    span: int | None
    cross_len: int = 0
    cross_mask: Tensor | None = None

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.cache.write(layer, self.tables, self.positions, self.real, k, v)
        if self.span is None:
            # Attend over what the cache holds, as every later read will: a cache narrower than the
            # model (bfloat16 K/V of a float32 model) rounds the new tokens too, so a prompt computed
            # whole equals one computed in chunks or found in the prefix cache.
            if self.cache.k.dtype != k.dtype:
                return k.to(self.cache.k.dtype).to(k.dtype), v.to(self.cache.v.dtype).to(v.dtype)
            return k, v
        # A cache kept in a narrower dtype than the model computes in (TSERVE_KV_DTYPE) is read
        # back in the model's dtype, in the same copy that gathers the blocks.
        return self.cache.read(layer, self.tables, self.span, k.dtype)  # 2 x (B, nkv, span, hs)

    def update_in_place(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a kernel that reads the blocks where they lie (decode, one new token per row):
        write k, v (B, nkv, 1, hs); return the layer's pool k, v as (blocks, nkv, block_len, hs) views,
        the rows' block tables (B, n) and how many positions each row sees (B,): up to and
        including the token just written."""
        if self.positions.size(1) != 1:
            raise ValueError("update_in_place is for one new token per row")
        self.cache.write(layer, self.tables, self.positions, self.real, k, v)
        return (self.cache.k[layer].transpose(0, 1), self.cache.v[layer].transpose(0, 1), self.tables,
                self.positions[:, 0] + 1)

    def cross(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
        return (*self.cache.read_cross(layer, self._memory_index, self.cross_len), self.cross_mask)

    def cross_in_place(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a kernel that reads the cross-attention memory where it lies: the layer's memory
        k, v (slots, nkv, max_src_len, hs), the rows' slots (B,) and source lengths (B,)."""
        return self.cache.cross_k[layer], self.cache.cross_v[layer], self._memory_rows, self._src_lengths

    @functools.cached_property
    def _src_lengths(self) -> Tensor:  # once per forward pass, not per layer
        return self.cache.src_lengths[self.batch.ids]

    @functools.cached_property
    def _memory_index(self) -> slice | Tensor:  # once per forward pass, not per layer
        return self.cache.memory_rows(self.batch)

    @functools.cached_property
    def _memory_rows(self) -> Tensor:
        return self.cache.cross_rows[self.batch.ids]
