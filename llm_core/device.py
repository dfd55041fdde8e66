"""Host-to-device copies for per-step metadata."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host: on CUDA through
    pinned memory (torch's caching host allocator makes pinning cheap after
    the first steps), so the copy is truly asynchronous."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
