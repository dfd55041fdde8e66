"""Attention backends for one engine step: they write a step's K/V into the
pools and run the chosen kernel (torch reference, Triton or C++ CPU), also
as an opaque op inside a compiled forward.

They sit above the kernels, which only see ``llm_core.kv.paged_attention``'s
batch types, so choosing a kernel by name imports no cycle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llm_core.model.config import AttentionSpec
from llm_core.kv.paged_attention import (
    AttentionFn,
    DecodeAttentionFn,
    DecodeBatch,
    KVCacheTensors,
    PagedBatch,
    attention_output,
    paged_attention_torch,
    store_kv,
)


class PagedAttentionBackend:
    """AttentionBackend for one engine step: writes the step's K/V into the
    pools, then attends over each request's visible slots."""

    def __init__(
        self, tensors: KVCacheTensors, full_batch: PagedBatch, swa_batch: PagedBatch, attention_fn: AttentionFn,
        before_layer: Callable[[int], None] | None = None,
    ) -> None:
        self.tensors = tensors
        self.full_batch = full_batch
        self.swa_batch = swa_batch
        self.attention_fn = attention_fn
        # Restores from the host tier copy layer by layer beside the forward:
        # a layer's attention first waits for that layer's pages.
        self.before_layer = before_layer

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        is_swa, k_cache, v_cache = self.tensors.layer(layer_idx)
        scales = self.tensors.scales(layer_idx)
        batch = self.swa_batch if is_swa else self.full_batch
        store_kv(k_cache, v_cache, batch.write_slots, k, v, scales)
        if self.before_layer is not None:
            self.before_layer(layer_idx)
        if torch.compiler.is_compiling():
            return traced_paged_attention(q, k_cache, v_cache, batch, spec.sliding_window, sinks,
                                          self.attention_fn.__name__, scales)
        return self.attention_fn(q, k_cache, v_cache, batch, spec.sliding_window, sinks, scales)

    def store_hidden(self, hidden: torch.Tensor) -> None:
        """The target's final hidden states of the step's rows, for the MTP layers."""
        self.tensors.store_target_hidden(self.swa_batch.write_slots, hidden)


@torch.library.custom_op("swallow::paged_attention", mutates_args=())
def _paged_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_pos: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    kv_table: torch.Tensor,
    kv_start: torch.Tensor,
    kv_len: torch.Tensor,
    kv_first_pos: torch.Tensor,
    bounds: torch.Tensor,
    page_size: int,
    sliding_window: int,
    sinks: torch.Tensor | None,
    kernel: str,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    rows = bounds.tolist()
    batch = PagedBatch(q_pos, q_start, q_len, kv_table, kv_start, kv_len, kv_first_pos, q_pos, page_size,
                       tuple((r[0], r[1]) for r in rows), tuple((r[2], r[3], r[4]) for r in rows), bounds)
    return attention_named(kernel)(q, k_cache, v_cache, batch, sliding_window or None, sinks, kv_scales)


def attention_named(name: str) -> AttentionFn:
    """An extend attention function by its ``__name__``: how a compiled forward's
    opaque op knows which one the engine chose."""
    if name == "paged_attention_triton":
        from llm_core.kv.triton_attention import paged_attention_triton

        return paged_attention_triton
    if name == "paged_attention_cpu":
        from llm_core.kv.cpu_kernels import paged_attention_cpu

        return paged_attention_cpu
    if name != paged_attention_torch.__name__:
        raise ValueError(f"no extend attention named {name!r}")
    return paged_attention_torch


_paged_attention_op.register_fake(attention_output)


def traced_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    kernel: str,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixed batch's attention as one opaque op of a compiled forward: its
    per-request bounds travel as a CPU tensor, so no value of them is guarded.
    ``kernel``: the ``__name__`` of the attention function to run. The C++
    CPU kernel is an op of its own, called without entering Python."""
    if kernel == "paged_attention_cpu":
        return attention_named(kernel)(q, k_cache, v_cache, batch, sliding_window, sinks, kv_scales)
    return torch.ops.swallow.paged_attention(
        q, k_cache, v_cache, batch.q_pos, batch.q_start, batch.q_len, batch.kv_table, batch.kv_start, batch.kv_len,
        batch.kv_first_pos, batch.host_bounds, batch.page_size, sliding_window or 0, sinks, kernel, kv_scales,
    )


class DecodeAttentionBackend:
    """AttentionBackend for a decode step (``DecodeBatch``): the same pools,
    metadata that is tensors only."""

    def __init__(self, tensors: KVCacheTensors, batch: DecodeBatch, attention_fn: DecodeAttentionFn) -> None:
        self.tensors = tensors
        self.batch = batch
        self.attention_fn = attention_fn

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        is_swa, k_cache, v_cache = self.tensors.layer(layer_idx)
        scales = self.tensors.scales(layer_idx)
        b = self.batch
        if is_swa:
            store_kv(k_cache, v_cache, b.swa_write, k, v, scales)
            return self.attention_fn(q, k_cache, v_cache, b.swa_slots, 1, b.swa_len, b.positions,
                                     spec.sliding_window, sinks, scales)
        store_kv(k_cache, v_cache, b.full_write, k, v, scales)
        return self.attention_fn(q, k_cache, v_cache, b.full_pages, b.page_size, b.positions + 1, b.positions,
                                 spec.sliding_window, sinks, scales)

    def store_hidden(self, hidden: torch.Tensor) -> None:
        """The target's final hidden states of the step's rows, for the MTP layers."""
        self.tensors.store_target_hidden(self.batch.swa_write, hidden)
