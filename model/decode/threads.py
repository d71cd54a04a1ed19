"""How many intra-op threads a decode step uses.

Under ``OMP_WAIT_POLICY=PASSIVE`` (what ``python -m service`` sets unless told otherwise, so
that two OpenMP threads do not spin against other work on a shared host) every parallel
region wakes its sleeping threads, and a decode step of a few rows is hundreds of small
regions. Measured on 2 cores, SmolLM2-135M int8, span 256 (by the decode-threads benchmark of
commit 8cba250, since removed): batch 1 decodes at 22 tok/s on two passive threads and 37 on one
(49 and 25 with the compiled step); batch 8 at 116 and 124 (194 and 160 compiled); batch 32
prefers two (217 against 175). So under a passive policy a decode step of at most
``SMALL_DECODE`` rows runs on one thread; otherwise nothing changes. With spinning threads
(the OpenMP default) two threads win at every batch size and are left alone.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

SMALL_DECODE = 8


def passive_wait() -> bool:
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


@contextmanager
def decode_threads(rows: int, small: int = SMALL_DECODE):
    """One intra-op thread for a decode step of ``rows`` rows where that was measured faster
    (see the module docstring; ``small``: up to how many rows); the calling thread's setting is
    restored afterwards."""
    threads = torch.get_num_threads()
    if threads == 1 or rows > small or not passive_wait():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
