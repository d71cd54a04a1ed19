"""Small host -> device copies that do not stall the device.

Per-step metadata (slot ids, positions, sampling parameters) starts as Python lists on
the host. On CUDA a plain ``torch.tensor(list, device="cuda")`` copies from pageable
memory and waits for the stream; staging through pinned memory with ``non_blocking``
queues the copy behind the running kernels instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(list(values), dtype=dtype)
    # Under torch.compile the copy is traced, and dynamo cannot trace pin_memory (seen on an
    # H100: "NYI: aten._pin_memory.default"); a plain copy there.
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return host.pin_memory().to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)
