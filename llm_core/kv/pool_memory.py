"""Memory for the KV pools: zeroed, and on the CPU without writing a byte.

An anonymous private mapping starts as zero pages that the kernel supplies on
first touch. A CPU pool of any size therefore costs nothing until its slots are
written, and its resident memory is what the cache holds. ``torch.zeros``
would write every byte at start: 0.24 s of every engine's construction for the
default 256 MiB budget, and the whole budget resident from the start.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["zeroed"]

# Below this, torch.zeros is as quick and keeps small buffers off their own mappings.
_MAPPED_FROM_BYTES = 1 << 20


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, with large CPU
    tensors on their own anonymous mapping (unmapped when the tensor goes)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _MAPPED_FROM_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private: a process forked later gets its own copy-on-write pages, never this one's.
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the mapping (frombuffer keeps a reference to it), so it lives as long.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
