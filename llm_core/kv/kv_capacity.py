"""How many decode-phase requests of a given context fit in a KV budget:
hybrid SWA pools against the full-attention baseline, through the real
allocator, for model shapes that need not fit on this machine."""

from __future__ import annotations

from typing import Any

import torch

from llm_core.model.config import ModelConfig
from llm_core.kv.kv_pool import FullKVPool, KVAllocator, PoolSizing, SWAKVPool
from llm_core.kv.paged_attention import KVCacheTensors

GIB = 1 << 30


def admit_until_refused(allocator: KVAllocator, context: int, chunk: int, limit: int) -> int:
    """Prefill requests of ``context`` tokens chunk by chunk, as the engine
    does, and leave them ready to decode; stop at the first refusal."""
    admitted = 0
    while admitted < limit:
        view = allocator.new_view()
        done = 0
        while done < context:
            end = min(context, done + chunk)
            # A decode-phase request also needs its next position.
            target = end + 1 if end == context else end
            if not allocator.can_grow(view, target):
                allocator.free(view)
                return admitted
            allocator.grow(view, target)
            allocator.release_out_of_window(view, end)
            done = end
        admitted += 1
    return admitted


def kv_capacity(
    config: ModelConfig,
    context: int,
    budget_bytes: int,
    page_size: int = 16,
    chunk: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """``dtype``: what the pools store (bfloat16, float8_e4m3fn, ...)."""
    tensors = KVCacheTensors(config, 0, 0, dtype, "meta")
    full_bpt, swa_bpt = tensors.full_bytes_per_token, tensors.swa_bytes_per_token
    window = config.sliding_attention.sliding_window or 1
    w = config.window_size
    all_full_bytes = context * (full_bpt + swa_bpt)
    hybrid_bytes = context * full_bpt + w * swa_bpt
    # The engine sizes the SWA pool for the requests it expects to run.
    expected = max(1, budget_bytes // hybrid_bytes)
    results: dict[str, Any] = {}
    for mode in ("hybrid", "full"):
        sizing = PoolSizing.from_budget(
            budget_bytes, full_bpt, swa_bpt, window + page_size - 1, page_size, expected, chunk, mode
        )
        allocator = KVAllocator(
            FullKVPool(sizing.full_tokens // page_size, page_size), SWAKVPool(sizing.swa_tokens, 1), window, mode
        )
        # The pools' tensors on the meta device: real shapes, no memory.
        pools = KVCacheTensors(config, allocator.full.capacity, allocator.swa.capacity, dtype, "meta")
        admitted = admit_until_refused(allocator, context, chunk, limit=10**7)
        pool_bytes = allocator.full.capacity * full_bpt + allocator.swa.capacity * swa_bpt
        results[mode] = {
            "max_requests": admitted,
            "full_pool_tokens": allocator.full.capacity,
            "swa_pool_tokens": allocator.swa.capacity,
            "pool_bytes": pool_bytes,
            "pool_tensor_shapes": pools.shapes,
        }
    theoretical = all_full_bytes / hybrid_bytes
    gain = results["hybrid"]["max_requests"] / max(results["full"]["max_requests"], 1)
    return {
        "context": context,
        "kv_cache_dtype": str(dtype).removeprefix("torch."),
        "kv_budget_gib": budget_bytes / GIB,
        "window": w,
        "full_bytes_per_token": full_bpt,
        "swa_bytes_per_token": swa_bpt,
        "hybrid_max_requests": results["hybrid"]["max_requests"],
        "full_max_requests": results["full"]["max_requests"],
        "gain": round(gain, 4),
        "theoretical_gain": round(theoretical, 4),
        "gain_vs_theoretical": round(gain / theoretical, 4),
        "pools": results,
    }
