"""Capacity planning for expert parallelism: for each EP size, what one GPU
holds in weights, how many requests of a given context its KV memory then
fits with SWA-aware pools against full-attention-style KV, and what each
token costs in all-to-all traffic. The "free KV memory lets EP shrink"
argument as a calculation anyone can redo with their own hardware numbers.

Assumptions (each a field of ``Hardware`` or stated where it is used):
* routed experts are sharded over the EP group, everything else (embeddings,
  attention, dense and shared parts, the router, norms, MTP layers) is
  replicated on every GPU;
* attention is data-parallel: each GPU keeps the KV of its own requests, so
  the cluster's concurrency is one GPU's times the number of GPUs;
* a token's hidden state goes to each of its ``num_experts_per_tok`` experts
  that lives on another rank and comes back (dispatch + combine), uniformly
  spread over the experts.

No torch kernels run: parameters are counted on the meta device, KV capacity
is the real pool allocator admitting requests (``llm_core.kv.kv_capacity``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llm_core.kv.kv_capacity import GIB, kv_capacity
from llm_core.model.config import ModelConfig
from llm_core.model.meta_build import meta_build

__all__ = ["ExpertSplit", "Hardware", "ParameterCounts", "WeightBytes", "parameter_counts", "plan", "weight_bytes"]

_ROUTED = (".experts.gate_up_proj", ".experts.down_proj")


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_mem_gib: float
    # Memory a GPU keeps for everything but weights and KV: activations, CUDA
    # graphs, communication buffers, allocator slack.
    reserve_gib: float = 10.0
    # How the weights are held: "fp8" as the published checkpoints are (and
    # Swallow keeps them where FP8 GEMMs run), or "bf16".
    weights: str = "fp8"
    activation_bytes: int = 2  # per hidden element sent in the all-to-all (BF16)
    kv_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpu_mem_gib <= 0 or self.reserve_gib < 0:
            raise ValueError("gpus must be >= 1, gpu memory > 0 and reserve >= 0")
        if self.weights not in ("fp8", "bf16"):
            raise ValueError(f"weights are held as 'fp8' or 'bf16', got {self.weights!r}")


@dataclass(frozen=True)
class ExpertSplit:
    """A quantity of the model (parameters, bytes) split by where EP puts it."""

    routed_experts: int  # sharded over the EP group
    replicated: int  # on every GPU

    @property
    def total(self) -> int:
        return self.routed_experts + self.replicated


ParameterCounts = WeightBytes = ExpertSplit


def parameter_counts(config: ModelConfig) -> ParameterCounts:
    """The model's parameters, built on the meta device (no memory), split into
    routed experts and the rest."""
    from llm_core.model.model import MiMoV2ForCausalLM

    with meta_build():
        model = MiMoV2ForCausalLM(config)
    routed = replicated = 0
    for name, param in model.named_parameters():
        if name.endswith(_ROUTED):
            routed += param.numel()
        else:
            replicated += param.numel()
    return ParameterCounts(routed, replicated)


def weight_bytes(config: ModelConfig, weights: str = "fp8") -> WeightBytes:
    """Resident bytes of the model's weights as the engine holds them, counted on
    the meta device: "fp8" as the published checkpoints are (FP8 matrices with
    their scale tables, o_proj and the small tensors BF16, the router float32),
    "bf16" as a BF16 checkpoint (router float32)."""
    from llm_core.model.fp8_linear import model_on_meta, published_fp8_scheme

    model = model_on_meta(config, published_fp8_scheme(config) if weights == "fp8" else None)
    routed = replicated = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        nbytes = tensor.numel() * tensor.element_size()
        if ".experts." in name:
            routed += nbytes
        else:
            replicated += nbytes
    return WeightBytes(routed, replicated)


def ep_sizes(gpus: int, experts: int) -> list[int]:
    """EP group sizes that split both the GPUs and the experts evenly."""
    return [n for n in range(1, gpus + 1) if gpus % n == 0 and experts % n == 0]


def all_to_all_bytes_per_token(config: ModelConfig, ep: int, activation_bytes: int) -> int:
    """Bytes one token sends and receives across ranks per forward: for each MoE
    layer, its hidden state to each of its experts on another rank (the expected
    share (ep - 1) / ep of them) and the expert's output back."""
    sparse_layers = sum(t == "sparse" for t in config.mlp_layer_types)
    remote = config.num_experts_per_tok * (ep - 1) / ep
    return round(2 * sparse_layers * remote * config.hidden_size * activation_bytes)


def plan(config: ModelConfig, hardware: Hardware, context: int, target_concurrency: int | None = None,
         page_size: int = 16) -> dict[str, Any]:
    """One row per EP size, and the smallest EP size whose cluster fits
    ``target_concurrency`` requests of ``context`` tokens, with SWA-aware pools
    and with full-attention-style KV. Without a target: what full-attention KV
    reaches at the largest EP size, the figure SWA should match with less EP."""
    counts = parameter_counts(config)
    resident = weight_bytes(config, hardware.weights)
    rows = [_row(config, hardware, resident, context, ep, page_size)
            for ep in ep_sizes(hardware.gpus, config.n_routed_experts)]
    if target_concurrency is None:
        target_concurrency = max(r["full_attention_requests"] for r in rows) or 1

    def smallest(key: str) -> int | None:
        return next((r["ep_size"] for r in rows if r[key] >= target_concurrency), None)

    return {
        "gpus": hardware.gpus,
        "gpu_mem_gib": hardware.gpu_mem_gib,
        "reserve_gib": hardware.reserve_gib,
        "weights": hardware.weights,
        "kv_cache_dtype": str(hardware.kv_dtype).removeprefix("torch."),
        "context": context,
        "parameters": {"total": counts.total, "routed_experts": counts.routed_experts,
                       "replicated": counts.replicated},
        "weight_bytes": {"total": resident.total, "routed_experts": resident.routed_experts,
                         "replicated": resident.replicated,
                         "per_parameter": round(resident.total / counts.total, 4)},
        "target_concurrency": target_concurrency,
        "smallest_ep_swa": smallest("swa_requests"),
        "smallest_ep_full_attention": smallest("full_attention_requests"),
        "ep": rows,
    }


def _row(config: ModelConfig, hardware: Hardware, resident: WeightBytes, context: int, ep: int,
         page_size: int) -> dict[str, Any]:
    weights = resident.replicated + resident.routed_experts / ep
    kv_budget = hardware.gpu_mem_gib * GIB - hardware.reserve_gib * GIB - weights
    row: dict[str, Any] = {
        "ep_size": ep,
        "replicas": hardware.gpus // ep,
        "experts_per_gpu": config.n_routed_experts // ep,
        "weights_gib_per_gpu": round(weights / GIB, 2),
        "kv_gib_per_gpu": round(max(kv_budget, 0) / GIB, 2),
        "all_to_all_bytes_per_token": all_to_all_bytes_per_token(config, ep, hardware.activation_bytes),
    }
    if kv_budget <= 0:
        return {**row, "fits": False, "swa_requests_per_gpu": 0, "full_attention_requests_per_gpu": 0,
                "swa_requests": 0, "full_attention_requests": 0}
    capacity = kv_capacity(config, context, int(kv_budget), page_size=page_size, dtype=hardware.kv_dtype)
    swa, full = capacity["hybrid_max_requests"], capacity["full_max_requests"]
    return {**row, "fits": True, "swa_requests_per_gpu": swa, "full_attention_requests_per_gpu": full,
            "swa_requests": swa * hardware.gpus, "full_attention_requests": full * hardware.gpus}
