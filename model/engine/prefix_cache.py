"""Prefix caching, the scheduler's half: which prompt blocks the pool holds, and where.

A decoder prompt is cut into blocks of ``PREFIX_BLOCK`` tokens. Each full block is named by
a hash chained over every block before it, so a block matches only under the very same
prefix from position 0; the K/V it stands for was computed at the same absolute positions
a new request would compute it at, so it can be copied into the request's slot as is (rope,
learned or sinusoidal positions alike).

The K/V lives in a ``PrefixKVPool`` of a fixed number of blocks (the memory budget), which
only the runner touches; this index is host bookkeeping: hash -> pool block, kept in LRU
order. Blocks that no request is copying in the current step may be evicted, least recently
used first, and a chain is touched leaf first so that its root is evicted last (a block whose
parent is gone can never match again).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

PREFIX_BLOCK = 32  # tokens per cached block: the unit of matching, storing and eviction
DEFAULT_PREFIX_CACHE_MB = 256.0  # the service's default budget (TSERVE_PREFIX_CACHE_MB)


def block_hashes(tokens: list[int], block: int = PREFIX_BLOCK) -> list[bytes]:
    """The chained hash of every full block of ``tokens``."""
    out, parent = [], b""
    for i in range(len(tokens) // block):
        chunk = tokens[i * block: (i + 1) * block]
        parent = hashlib.blake2b(parent + struct.pack(f"<{block}q", *chunk), digest_size=16).digest()
        out.append(parent)
    return out


class PrefixIndex:
    """hash -> pool block, LRU ordered; counts the prompt tokens asked and found."""

    def __init__(self, n_blocks: int, block: int = PREFIX_BLOCK):
        self.n_blocks, self.block = n_blocks, block
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.free = list(range(n_blocks - 1, -1, -1))
        self.pinned: set[bytes] = set()  # copied into a slot by the step being planned
        self.hit_tokens = 0
        self.query_tokens = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, hashes: list[bytes], prompt_len: int) -> int:
        """How many leading blocks are cached, leaving at least the last prompt token to
        compute (its logits choose the first new token)."""
        n, limit = 0, min(len(hashes), (prompt_len - 1) // self.block)
        while n < limit and hashes[n] in self.blocks:
            n += 1
        return n

    def take(self, hashes: list[bytes], n: int, prompt_len: int) -> list[int]:
        """The pool blocks of the first ``n`` hashes, pinned for this step; counts the query."""
        self.query_tokens += prompt_len
        self.hit_tokens += n * self.block
        self.pinned.update(hashes[:n])
        self._touch(hashes[:n])
        return [self.blocks[h] for h in hashes[:n]]

    def insert(self, hashes: list[bytes], first: int, last: int) -> list[tuple[int, int]]:
        """Make room for blocks ``first .. last - 1`` of a chain whose K/V is in a slot:
        (block index in the prompt, pool block) for each one to copy. Stops early when
        nothing is left to evict; blocks already cached are only touched."""
        out = []
        for i in range(first, last):
            h = hashes[i]
            if h in self.blocks:
                continue
            pool_block = self._allocate(set(hashes[:last]))
            if pool_block is None:
                break
            self.blocks[h] = pool_block
            out.append((i, pool_block))
        self._touch(hashes[:last])
        return out

    def forget(self, hashes: list[bytes]) -> None:
        """Drop blocks whose copy never happened (the step failed)."""
        for h in hashes:
            block = self.blocks.pop(h, None)
            if block is not None:
                self.free.append(block)

    def end_step(self) -> None:
        self.pinned.clear()

    def _touch(self, chain: list[bytes]) -> None:
        for h in reversed(chain):  # leaf first: the root ends most recently used
            if h in self.blocks:
                self.blocks.move_to_end(h)

    def _allocate(self, keep: set[bytes]) -> int | None:
        if self.free:
            return self.free.pop()
        for h in self.blocks:  # least recently used first
            if h not in self.pinned and h not in keep:
                return self.blocks.pop(h)
        return None
