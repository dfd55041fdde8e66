"""An engine's KV memory, built once: both pools sized from the budget, the
KV tensors, the block table, and the prefix cache with its host and disk
tiers under it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

from llm_core.kv.block_table import BlockTable
from llm_core.engine_config import EngineConfig, resolve_kv_dtype
from llm_core.kv.kv_events import KVEventLog
from llm_core.kv.kv_pool import FullKVPool, KVAllocator, PoolSizing, SWAKVPool
from llm_core.kv.tiers.kv_disk_store import DiskKVStore
from llm_core.kv.tiers.kv_store import HostKVPool
from llm_core.kv.tiers.kv_tiers import KVTiers, TierConfig
from llm_core.kv.tiers.kv_transfer import RESTORE_BUCKETS, EngineTierIO, model_weights_digest
from llm_core.model.model import MiMoV2ForCausalLM
from llm_core.kv.page_address import model_fingerprint
from llm_core.kv.paged_attention import KVCacheTensors
from llm_core.kv.prefix_cache import RadixCache

__all__ = ["EngineKV", "build_cache", "build_kv", "fingerprint", "kv_cache_scales", "memory_stats"]


def kv_cache_scales(model: MiMoV2ForCausalLM) -> dict[int, tuple[float, float]]:
    """(k_scale, v_scale) of every layer with KV, main and MTP, by KV layer index."""
    mc = model.config
    attentions = [layer.self_attn for layer in model.model.layers]
    if mc.num_mtp_layers:
        attentions += [layer.self_attn for layer in model.model.mtp.layers]
    # A model on the meta device (capacity math) has no values: the pools take 1.0.
    return {a.layer_idx: (float(a.k_scale), float(a.v_scale)) for a in attentions if not a.k_scale.is_meta}


@dataclass(frozen=True)
class EngineKV:
    allocator: KVAllocator
    kv: KVCacheTensors
    block_table: BlockTable
    window: int  # the sliding window, in tokens
    # What KV written here needs another engine to share to read it (PD
    # transfers and tier addresses check it): the KV dtype and FP8 scales.
    layout: str

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """A request that could never fit in the full pool is refused up front."""
        if num_prompt_tokens + max_tokens > self.allocator.full.capacity:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens={max_tokens} needs more KV "
                f"memory than the pool holds ({self.allocator.full.capacity} tokens)"
            )
        longest = self.block_table.width * self.allocator.full.page_size
        if num_prompt_tokens + max_tokens > longest:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens={max_tokens} is longer than "
                f"a sequence may be ({longest} tokens)"
            )


def build_kv(model: MiMoV2ForCausalLM, config: EngineConfig, device: torch.device, num_speculative: int) -> EngineKV:
    mc = model.config
    dtype = model.lm_head.weight.dtype
    k = num_speculative
    # Without speculation the MTP layers are never run: no KV for them.
    kv_layout = {"mtp_layers": mc.num_mtp_layers if k else 0, "draft_depths": min(k, mc.num_mtp_layers),
                 "kv_dtype": resolve_kv_dtype(config.kv_cache_dtype, dtype), "kv_scales": kv_cache_scales(model)}
    probe = KVCacheTensors(mc, 0, 0, dtype, "meta", **kv_layout)
    window = mc.sliding_attention.sliding_window or 1
    sizing = PoolSizing.from_budget(
        config.kv_budget_bytes,
        probe.full_bytes_per_token,
        probe.swa_bytes_per_token,
        # Windows are kept from a page boundary: up to a page more per
        # request, and the drafts of a verify step.
        window + config.page_size - 1 + k,
        config.page_size,
        config.max_running_requests,
        config.max_num_batched_tokens,
        config.swa_mode,
    )
    allocator = KVAllocator(
        FullKVPool(sizing.full_tokens // config.page_size, config.page_size),
        SWAKVPool(sizing.swa_tokens, 1),
        window,
        config.swa_mode,
    )
    kv = KVCacheTensors(mc, allocator.full.capacity, allocator.swa.capacity, dtype, device,
                        config.page_size, **kv_layout, draft_slots=k * config.max_running_requests)
    scales = sorted(kv.scale_values().items())
    longest = min(mc.max_position_embeddings, allocator.full.capacity)
    block_table = BlockTable(-(-longest // config.page_size), device, config.max_running_requests)
    return EngineKV(allocator, kv, block_table, window, f"kv={kv.kv_dtype}" + (f";scales={scales}" if scales else ""))


def fingerprint(model: MiMoV2ForCausalLM, config: EngineConfig, engine_kv: EngineKV) -> bytes:
    """The root of the page address chain: pages are comparable only for
    the same weights, KV layout, dtypes and FP8 scales."""
    kv = engine_kv.kv
    return model_fingerprint(json.dumps(asdict(model.config), sort_keys=True, default=str),
                             model_weights_digest(model), str(model.lm_head.weight.dtype), str(config.page_size),
                             f"mtp={kv.draft_depths}", str(sorted(kv.shapes.items())), engine_kv.layout)


def build_cache(config: EngineConfig, engine_kv: EngineKV, device: torch.device, fingerprint: bytes | None,
                events: KVEventLog | None) -> tuple[RadixCache, EngineTierIO | None]:
    """The radix cache, with host and disk tiers under it when configured (and their copies)."""
    allocator, kv = engine_kv.allocator, engine_kv.kv
    if not config.kv_host_bytes:
        return RadixCache(allocator, config.checkpoint_interval, fingerprint=fingerprint, events=events), None
    largest = config.page_size * (kv.full_bytes_per_token + kv.swa_bytes_per_token)
    if config.kv_host_bytes < largest:
        raise ValueError(f"kv_host_bytes={config.kv_host_bytes} cannot hold one page of full and SWA KV "
                         f"({largest} bytes)")
    assert fingerprint is not None
    tier_config = TierConfig(config.kv_host_bytes, config.kv_disk_bytes, config.page_size * kv.full_bytes_per_token,
                             kv.swa_bytes_per_token)
    host = HostKVPool(config.kv_host_bytes, pin_memory=device.type == "cuda")
    # The tiers' bookkeeping holds the budget; the store's own limit only
    # leaves room for file headers.
    disk = DiskKVStore(config.kv_disk_dir, 2 * config.kv_disk_bytes + (1 << 20), fingerprint) \
        if config.kv_disk_bytes else None
    tier_io = EngineTierIO(kv, host, disk, layerwise_restore=config.kv_restore_layerwise)
    tiers = KVTiers(tier_config, tier_io, events.record_tier_key if events is not None else None)
    if disk is not None:
        tiers.adopt_disk_entries((key, entry.tokens) for key, entry in disk.entries())
    cache = RadixCache(allocator, config.checkpoint_interval, tiers=tiers, fingerprint=fingerprint, events=events)
    return cache, tier_io


def memory_stats(config: EngineConfig, engine_kv: EngineKV, cache: RadixCache | None,
                 tier_io: EngineTierIO | None) -> dict[str, Any]:
    """Both pools, the prefix cache and its tiers, as ``Engine.stats`` reports them."""
    full, swa, kv = engine_kv.allocator.full, engine_kv.allocator.swa, engine_kv.kv
    stats = cache.stats if cache is not None else None
    return {
        "prefix_cache": None if cache is None or stats is None else {
            "cached_prompt_tokens": stats.cached_prompt_tokens,
            "computed_prompt_tokens": stats.computed_prompt_tokens,
            "hit_rate": round(stats.hit_rate, 4),
            "nodes": cache.num_nodes,
            "swa_slots_cached": cache.swa_slots_cached,
            "cached_tokens_by_tier": dict(stats.cached_tokens_by_tier),
        },
        "kv_tiers": _tier_stats(cache, tier_io),
        "swa_mode": config.swa_mode,
        "kv_cache_dtype": str(kv.kv_dtype).removeprefix("torch."),
        "full_pool": {"capacity_tokens": full.capacity, "free_tokens": full.free_slots,
                      "bytes_per_token": kv.full_bytes_per_token},
        "swa_pool": {"capacity_tokens": swa.capacity, "free_tokens": swa.free_slots,
                     "bytes_per_token": kv.swa_bytes_per_token},
    }


def _tier_stats(cache: RadixCache | None, io: EngineTierIO | None) -> dict[str, Any] | None:
    tiers = cache.tiers if cache is not None else None
    if tiers is None or io is None:
        return None
    return {**tiers.as_dict(), "restore_seconds_buckets": list(RESTORE_BUCKETS),
            "restore_seconds_counts": list(io.restore_seconds), "restore_seconds_sum": io.restore_seconds_sum,
            "checksum_failures": io.host.checksum_failures
            + (io.disk.checksum_failures + io.disk.missing + io.disk.scan_dropped if io.disk is not None else 0)}
