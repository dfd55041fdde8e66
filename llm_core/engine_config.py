"""The engine's configuration, fixed when the engine is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llm_core.model.fp8 import FP8_DTYPE
from llm_core.kv.kv_pool import SWAMode

__all__ = ["AttentionImpl", "EngineConfig", "KVCacheDtype", "KV_CACHE_DTYPES", "MAX_SPECULATIVE_TOKENS",
           "resolve_kv_dtype", "resolve_speculative_tokens"]

AttentionImpl = Literal["auto", "torch", "triton"]
KVCacheDtype = Literal["auto", "bf16", "fp8_e4m3"]
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class EngineConfig:
    kv_budget_bytes: int = 256 << 20
    page_size: int = 16
    swa_mode: SWAMode = "hybrid"
    max_running_requests: int = 64
    max_num_batched_tokens: int = 4096
    chunked_prefill_size: int = 1024
    attention: AttentionImpl = "auto"
    enable_prefix_caching: bool = True
    # Extra SWA checkpoints every N tokens (besides prompt ends and finished
    # requests), so a prompt diverging mid-way falls back at most this far.
    checkpoint_interval: int | None = 4096
    # torch.compile(fullgraph=True) the decode forward (one graph, dynamic
    # batch and context sizes; the first steps pay for compiling it).
    compile: bool = False
    # On CUDA with the Triton kernels: replay decode steps of up to this many
    # requests from CUDA graphs captured at start-up for padded batch sizes
    # (0: never; None: up to max_running_requests).
    cuda_graph_max_batch: int | None = None
    # MTP speculative decoding: draft tokens verified per step (None: one per
    # MTP layer the checkpoint has; 0: off). More than the layers reuses the last.
    speculative_tokens: int | None = None
    # KV tiers under the device pools (prefix caching on): host memory, and
    # files under kv_disk_dir (which outlive the process: a restart over the
    # same directory restores earlier prefixes). 0: no such tier.
    kv_host_bytes: int = 0
    kv_disk_bytes: int = 0
    kv_disk_dir: str | None = None
    # Restores from host memory copied layer by layer beside the forward
    # (attention at layer i waits for layer i's pages only); None: on CUDA,
    # where copies and compute do not share the same cores.
    kv_restore_layerwise: bool | None = None
    # Admission order and preemption victims: "compute-aware" (fewest tokens
    # left to compute after the cache hit, with aging), "fcfs" or "lpm".
    schedule_policy: str = "compute-aware"
    # Prompt-length bucket edges sharing each step's prefill budget; None:
    # 64K and 256K of a 1M context, scaled to the model's context length.
    schedule_bucket_edges: tuple[int, ...] | None = None
    # See SchedulerConfig.prefill_batch_tokens (None: admission limited by the budget alone).
    prefill_batch_tokens: int | None = None
    # What both KV pools store: the model's dtype ("auto"), bfloat16, or
    # float8_e4m3fn with per-layer scales (the checkpoint's, else 1.0).
    kv_cache_dtype: KVCacheDtype = "auto"

    def __post_init__(self) -> None:
        if self.swa_mode not in ("hybrid", "full"):
            raise ValueError(f"swa_mode must be 'hybrid' or 'full', got {self.swa_mode!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.attention not in ("auto", "torch", "triton"):
            raise ValueError(f"attention must be 'auto', 'torch' or 'triton', got {self.attention!r}")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")
        if self.speculative_tokens is not None and not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be from 0 to {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.speculative_tokens}")
        if self.kv_host_bytes < 0 or self.kv_disk_bytes < 0:
            raise ValueError("kv_host_bytes and kv_disk_bytes must be >= 0")
        if self.kv_disk_bytes and not self.kv_disk_dir:
            raise ValueError("a disk KV tier (kv_disk_bytes) needs kv_disk_dir")
        if self.kv_disk_bytes and not self.kv_host_bytes:
            raise ValueError("a disk KV tier needs a host KV tier too (kv_host_bytes): disk writes go through it")


def resolve_speculative_tokens(requested: int | None, num_mtp_layers: int) -> int:
    """Drafts per step: as asked, or one per MTP layer the checkpoint has."""
    if requested is None:
        return num_mtp_layers
    if requested and not num_mtp_layers:
        raise ValueError(f"speculative_tokens={requested} needs MTP layers, and this checkpoint has none")
    return requested


def resolve_kv_dtype(kv_cache_dtype: KVCacheDtype, model_dtype: torch.dtype) -> torch.dtype:
    return {"auto": model_dtype, "bf16": torch.bfloat16, "fp8_e4m3": FP8_DTYPE}[kv_cache_dtype]
