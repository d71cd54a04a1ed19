"""Process-group set-up for ``torchrun`` (DistributedDataParallel): gloo on CPU, NCCL on GPU.

Without ``WORLD_SIZE`` in the environment everything is a single process and every
collective below is a no-op, so the training loop has one code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Distributed:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @classmethod
    def from_env(cls, device: str | None = None) -> Distributed:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        want_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        if want_cuda:
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
        else:
            dev = torch.device("cpu")
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if want_cuda else "gloo")
        return cls(rank, world, local, dev)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def any_true(self, flag: bool) -> bool:
        """True on every rank if it is true on any (e.g. rank 0 hit the time limit)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()
