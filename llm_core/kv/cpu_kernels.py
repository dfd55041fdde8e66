"""The C++ CPU kernels (``csrc/``), registered as torch ops ``swallow_cpu::*``.

* ``paged_decode_attention``: decode attention read in place through the page
  table. The torch decode path gathers every request's keys into a [B, keys,
  heads, dim] copy and reads it again: three passes over the KV memory a step
  reads, and most of a CPU decode step. The kernel reads K/V once.
* ``paged_extend_attention``: a mixed batch's attention (prefill chunks and
  decode rows), full and sliding layers alike. A block of a request's query
  rows shares each tile of its keys, gathered once, where running each row
  through the decode kernel paid per row, and torch's fused SDPA (for full
  layers) runs slowly at these head sizes.
* ``routed_experts``: a MoE layer's experts over only the tokens routed to
  each (float32). Traced forwards otherwise compute every expert on every
  token (static shapes), ``experts / top_k`` times the work, and the eager
  grouped products pay tens of microseconds of dispatch per expert.

All are ops of a C++ library (not Python custom ops), so a compiled forward
calls each as one opaque node without entering Python. They are built on first
use (``python -m llm_core.kv.cpu_kernels`` builds them ahead); where they cannot be
(no compiler) ``available`` is False and the torch paths are used.
"""

from __future__ import annotations

from functools import cache

import torch

from llm_core import native
from llm_core.kv.paged_attention import PagedBatch, attention_output

_SOURCES = ("paged_decode_attention.cpp", "paged_extend_attention.cpp", "routed_experts.cpp")


@cache
def available() -> bool:
    if native.build("swallow_cpu_kernels", _SOURCES, "CPU kernels", ops_library=True) is None:
        return False
    torch.library.register_fake("swallow_cpu::paged_decode_attention")(attention_output)
    torch.library.register_fake("swallow_cpu::paged_extend_attention")(attention_output)
    torch.library.register_fake("swallow_cpu::routed_experts")(_experts_output)
    return True


def _experts_output(x: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(x)


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    kv_len: torch.Tensor,
    q_pos: torch.Tensor,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for ``paged_decode_attention_torch`` on CPU tensors (FP8 pools included).
    Full layers go through the extend kernel, one query row per request: its
    tiles serve a GQA group's heads with shared loads, about 1.5x the decode
    kernel over hundreds of keys; a window's few keys are the decode kernel's."""
    if sliding_window is not None:
        return torch.ops.swallow_cpu.paged_decode_attention(q, k_cache, v_cache, pages, page_size, kv_len, q_pos,
                                                            sliding_window, sinks, kv_scales)
    batch, width = pages.shape
    rows = torch.arange(batch, dtype=torch.int64)
    kv_len = kv_len.to(torch.int64)
    # Per request: its query row, 1 row, its pages' offset, its keys, its first key's position.
    bounds = torch.stack([rows, torch.ones_like(rows), rows * width, kv_len, q_pos - kv_len + 1], dim=1)
    return torch.ops.swallow_cpu.paged_extend_attention(q, k_cache, v_cache, pages.reshape(-1), page_size, bounds,
                                                        q_pos, 0, sinks, kv_scales)


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for ``paged_attention_torch`` on CPU tensors: each block of a
    request's query rows shares every tile of keys it sees (csrc/paged_extend_attention.cpp)."""
    assert batch.host_bounds is not None, "a PagedBatch built by build/from_block_table carries host_bounds"
    return torch.ops.swallow_cpu.paged_extend_attention(q, k_cache, v_cache, batch.kv_table, batch.page_size,
                                                        batch.host_bounds, batch.q_pos, sliding_window or 0,
                                                        sinks, kv_scales)


def routed_experts_cpu(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor) -> torch.Tensor:
    """``RoutedExperts`` on float32 CPU tensors: x [T, H], weights and expert_ids
    [T, K], gate_up [E, 2I, H], down [E, H, I]. Fastest with the experts in
    k-major memory (``layers.k_major``), as the CPU loader stores them."""
    return torch.ops.swallow_cpu.routed_experts(x, weights, expert_ids, gate_up, down)


if __name__ == "__main__":  # `python -m llm_core.kv.cpu_kernels`: build ahead of the first engine
    print("C++ CPU kernels:", "built" if available() else "unavailable (the torch paths are used)")
