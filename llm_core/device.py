"""Host-to-device copies for per-step metadata."""

from __future__ import annotations

import torch

__all__ = ["column", "to_device"]


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host: on CUDA through
    pinned memory (torch's caching host allocator makes pinning cheap after
    the first steps), so the copy is truly asynchronous."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def column(table: torch.Tensor, i: int) -> torch.Tensor:
    """Column ``i`` of a 2-D table as a tensor of its own, stride 1 whatever the
    row count: a compiled forward guards on strides, and a one-row table's
    column would otherwise keep the table's row stride and recompile it."""
    return table[:, i].clone(memory_format=torch.contiguous_format)
