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
from pathlib import Path

import torch

__all__ = ["check_fits_in_memory", "zeroed"]

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
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # the kernel refuses a mapping far beyond its memory
        raise ValueError(f"cannot map {nbytes / (1 << 20):.0f} MiB for a KV pool ({exc.strerror}): "
                         "lower the KV budget (--kv-budget-mib)") from None
    # The tensor holds the mapping (frombuffer keeps a reference to it), so it lives as long.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def check_fits_in_memory(pools: list[torch.Tensor], meminfo: Path = Path("/proc/meminfo")) -> None:
    """Refuse, at start and with the numbers, CPU pools larger than the memory
    the machine has available: their pages are committed only as they are
    written, so without this check such a budget would start and be killed
    under load. Where ``meminfo`` cannot be read nothing is checked."""
    host = sum(t.numel() * t.element_size() for t in pools if t.device.type == "cpu")
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    if host > available:
        raise ValueError(f"the KV pools need {host / (1 << 20):.0f} MiB of host memory, and this machine has "
                         f"{available / (1 << 20):.0f} MiB available: lower the KV budget (--kv-budget-mib)")
