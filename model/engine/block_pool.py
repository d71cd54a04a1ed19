"""The block pool the scheduler drives: reference counts, the free list, and the prefix cache's
names for blocks, kept apart from the cache's tensors (as vLLM keeps its block pool apart
from the worker's KV tensors).

``model.nn.kv_cache.BlockRefs`` counts references for the block tables; ``BlockPool`` adds
the names: a full prompt block named by its chained hash (model.engine.prefix_cache) stays
readable after its last reference goes, least recently used first, until an allocation finds
the free list empty and evicts it. Host bookkeeping only: never touches a tensor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from model.nn.kv_cache import NULL_BLOCK, BlockRefs


class BlockPool(BlockRefs):
    """A pool's blocks with the prefix cache's names (hash -> block); the unreferenced named
    blocks kept in LRU order, evicted when the free list runs dry."""

    def __init__(self, n_blocks: int):
        super().__init__(n_blocks)
        self.named: dict[bytes, int] = {}  # prefix cache: chained block hash -> block
        self.name_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # named, unreferenced: least recently used first
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks an allocation can get now: free ones and cached ones nobody references."""
        return len(self.free) + len(self.evictable)

    def _take(self) -> int | None:
        block = super()._take()
        if block is None and self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.named[self.name_of.pop(block)]
            self.evictions += 1
        return block

    def incref(self, block: int) -> None:
        if block != NULL_BLOCK and self.refs[block] == 0:
            self.evictable.pop(block, None)
        super().incref(block)

    def _unreferenced(self, block: int) -> None:
        if block in self.name_of:
            self.evictable[block] = None  # most recently used end
        else:
            super()._unreferenced(block)

    # --- the prefix cache's names --------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes], limit: int) -> list[int]:
        """The blocks of the longest run of ``hashes[:limit]`` the pool names."""
        out = []
        for h in hashes[:limit]:
            block = self.named.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def name(self, h: bytes, block: int) -> None:
        """Name a full block of prompt K/V by its chained hash (first name wins)."""
        if h not in self.named and block not in self.name_of:
            self.named[h] = block
            self.name_of[block] = h

    def forget(self, block: int) -> None:
        """Drop a block's name (its K/V was never written: the step that was to write it failed)."""
        h = self.name_of.pop(block, None)
        if h is None:
            return
        del self.named[h]
        if block in self.evictable:  # nobody references it: free (otherwise it is freed when released)
            del self.evictable[block]
            self.free.append(block)
