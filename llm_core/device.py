"""Host-to-device copies for per-step metadata."""

from __future__ import annotations

import torch

__all__ = ["COMPUTE_DTYPES", "column", "compute_dtype", "to_device"]

# What an engine or an encoder computes in, by the names the command line takes.
COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                          "float16": torch.float16}


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype ``name`` stands for; a ValueError naming the choices for any other name."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(COMPUTE_DTYPES)}, got {name!r}")
    return COMPUTE_DTYPES[name]


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
