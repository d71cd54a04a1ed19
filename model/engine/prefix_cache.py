"""Prefix caching over the paged KV cache: prompt blocks named by a hash, read in place.

A decoder prompt is cut into blocks of the cache's ``BLOCK_LEN`` tokens. Each full block is
named by a hash chained over every block before it, so a block matches only under the very
same prefix from position 0; the K/V it holds was computed at the same absolute positions a
new request would compute it at, so a new request's block table simply starts with those
blocks (rope, learned or sinusoidal positions alike): no copy, whatever the prefix's length.

The names live in the pool (``model.engine.block_pool.BlockPool``): a named block nobody references
any more stays readable until an allocation needs it, least recently released first, and a
sequence releases its blocks last first, so that a chain's root is evicted last (a block whose
parent is gone can never match again). This class keeps the policy and the counters.
"""

from __future__ import annotations

import hashlib
import struct

from model.engine.block_pool import BlockPool


def block_hashes(tokens: list[int], block: int) -> list[bytes]:
    """The chained hash of every full block of ``tokens``."""
    out, parent = [], b""
    for i in range(len(tokens) // block):
        chunk = tokens[i * block: (i + 1) * block]
        parent = hashlib.blake2b(parent + struct.pack(f"<{block}q", *chunk), digest_size=16).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Matching and naming prompt blocks in ``pool``; counts the prompt tokens asked and found."""

    def __init__(self, pool: BlockPool, block: int):
        self.pool, self.block = pool, block
        self.hit_tokens = 0
        self.query_tokens = 0

    def __len__(self) -> int:
        return len(self.pool.named)

    def match(self, hashes: list[bytes], prompt_len: int) -> list[int]:
        """The cached blocks of the prompt's longest cached prefix, leaving at least the last
        prompt token to compute (its logits choose the first new token)."""
        return self.pool.lookup(hashes, min(len(hashes), (prompt_len - 1) // self.block))

    def count(self, prompt_len: int, hit_blocks: int) -> None:
        self.query_tokens += prompt_len
        self.hit_tokens += hit_blocks * self.block
