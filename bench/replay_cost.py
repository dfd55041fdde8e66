"""How long a replayed step takes: what a cost model sees of one step
(``StepShape``, from the chunks the scheduler scheduled) and the two cost
models the schedule and router benches replay with.

* ``mimo-v2.5-pro-h200`` (``AnalyticCost``): a step of MiMo-V2.5-Pro on one
  node of 8 H200s, from the preset's shapes: compute time is the step's
  FLOPs (2 x active parameters per row, plus attention over each row's
  context, SWA layers over at most the window) at a fraction of peak; memory
  time is the bytes it reads (non-expert weights, the experts its rows
  touch, the KV it attends) at a fraction of HBM bandwidth; the step takes
  the larger of the two plus a fixed overhead. The constants are fields of
  the dataclass, stated in ``docs/benchmarks.md``.
* ``calibrated`` (``LinearCost``, measured by ``bench/schedule.py``):
  the engine's own step time on this machine for the demo-size model,
  measured over prefill chunks and decode batches of several sizes and
  contexts and fitted as a linear model of the same step features.

Pure logic: no model runs here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

from bench.prefix_cache import MIMO_WINDOW
from llm_core.model.config import ModelConfig
from llm_core.sched.scheduler import ScheduledChunk

__all__ = ["FEATURES", "AnalyticCost", "CostModel", "LinearCost", "StepShape", "attended_positions", "step_shape"]


@dataclass(frozen=True)
class StepShape:
    """What a cost model sees of one step."""

    prefill_tokens: int = 0
    prefill_attended: int = 0  # sum over prefill rows of the positions each attends (full layers)
    prefill_attended_swa: int = 0  # the same, capped at the window (SWA layers)
    prefill_context: int = 0  # sum over prefill chunks of the cached positions before them (KV read)
    decode_rows: int = 0
    decode_context: int = 0  # sum over decode rows of their context
    decode_context_swa: int = 0
    sampled_rows: int = 0

    @property
    def rows(self) -> int:
        return self.prefill_tokens + self.decode_rows


def attended_positions(start: int, n: int, cap: int | None = None) -> int:
    """Sum of min(p, cap) for p in start + 1 .. start + n (each row sees itself)."""
    lo, hi = start + 1, start + n
    if cap is None or hi <= cap:
        return (lo + hi) * n // 2
    if lo > cap:
        return cap * n
    return (lo + cap) * (cap - lo + 1) // 2 + cap * (hi - cap)


def step_shape(chunks: Iterable[ScheduledChunk], window: int) -> StepShape:
    pt = pa = pas = pc = dr = dc = dcs = sampled = 0
    for chunk in chunks:
        sampled += chunk.samples
        if chunk.length == 1 and chunk.seq.output:
            dr += chunk.rows
            dc += (chunk.start + 1) * chunk.rows
            dcs += min(chunk.start + 1, window) * chunk.rows
            continue
        pt += chunk.rows
        pa += attended_positions(chunk.start, chunk.rows)
        pas += attended_positions(chunk.start, chunk.rows, window)
        pc += chunk.start
    return StepShape(pt, pa, pas, pc, dr, dc, dcs, sampled)


class CostModel(Protocol):
    name: str

    def step_seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True)
class AnalyticCost:
    """Step time of a MiMo-V2 model on a node of ``gpus`` H200s (EP across them)."""

    name: str
    active_params: float  # per row: attention, dense MLP share, routed experts (k of E)
    lm_head_params: float  # per sampled row
    dense_bytes: float  # weights every step reads whatever its rows (all but routed experts)
    expert_bytes: float  # one expert of one MoE layer
    moe_layers: int
    experts: int
    experts_per_token: int
    full_attn_flops_per_key: float  # per query row, per attended key, summed over full layers
    swa_attn_flops_per_key: float  # the same over SWA (and no MTP) layers
    full_kv_bytes_per_token: float
    swa_kv_bytes_per_token: float
    gpus: int = 8
    peak_flops: float = 989e12  # H200 dense BF16 per GPU
    hbm_bytes_per_s: float = 4.8e12  # H200 HBM3e per GPU
    compute_efficiency: float = 0.5  # achieved fraction of peak on large batches
    bandwidth_efficiency: float = 0.7
    step_overhead_s: float = 0.002  # launch, scheduling, expert-parallel all-to-all latency

    @classmethod
    def for_preset(cls, config: ModelConfig, name: str = "mimo-v2.5-pro-h200", weight_bytes: float = 1.0,
                   kv_bytes: float = 2.0) -> AnalyticCost:
        """FP8 weights (``weight_bytes`` per parameter), BF16 KV."""
        h = config.hidden_size
        full, swa = config.full_attention, config.sliding_attention

        def attn_params(spec: Any) -> float:
            return h * spec.num_heads * spec.head_dim + h * spec.num_kv_heads * (spec.head_dim + spec.v_head_dim) \
                + spec.num_heads * spec.v_head_dim * h

        n_full, n_swa = len(config.full_layer_ids), len(config.sliding_layer_ids)
        attention = n_full * attn_params(full) + n_swa * attn_params(swa)
        moe_layers = sum(t == "sparse" for t in config.mlp_layer_types)
        dense_mlp = (len(config.mlp_layer_types) - moe_layers) * 3 * h * config.intermediate_size
        expert = 3 * h * config.moe_intermediate_size
        routers = moe_layers * h * config.n_routed_experts
        lm_head = h * config.vocab_size
        active = attention + dense_mlp + routers + moe_layers * config.num_experts_per_tok * expert
        return cls(
            name=name, active_params=active, lm_head_params=lm_head,
            dense_bytes=(attention + dense_mlp + routers + lm_head) * weight_bytes, expert_bytes=expert * weight_bytes,
            moe_layers=moe_layers, experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok,
            full_attn_flops_per_key=n_full * 2 * full.num_heads * (full.head_dim + full.v_head_dim),
            swa_attn_flops_per_key=n_swa * 2 * swa.num_heads * (swa.head_dim + swa.v_head_dim),
            full_kv_bytes_per_token=n_full * full.kv_elements_per_token * kv_bytes,
            swa_kv_bytes_per_token=n_swa * swa.kv_elements_per_token * kv_bytes,
        )

    def step_seconds(self, s: StepShape) -> float:
        rows = s.rows
        if rows == 0:
            return 0.0
        flops = 2 * self.active_params * rows + 2 * self.lm_head_params * s.sampled_rows
        flops += self.full_attn_flops_per_key * (s.prefill_attended + s.decode_context)
        flops += self.swa_attn_flops_per_key * (s.prefill_attended_swa + s.decode_context_swa)
        touched = self.experts * (1 - (1 - self.experts_per_token / self.experts) ** rows)
        read = self.dense_bytes + self.moe_layers * touched * self.expert_bytes
        read += self.full_kv_bytes_per_token * (s.prefill_context + s.decode_context)
        read += self.swa_kv_bytes_per_token * (s.decode_context_swa + min(s.prefill_context, MIMO_WINDOW))
        compute_s = flops / (self.gpus * self.peak_flops * self.compute_efficiency)
        memory_s = read / (self.gpus * self.hbm_bytes_per_s * self.bandwidth_efficiency)
        return max(compute_s, memory_s) + self.step_overhead_s

    def describe(self) -> dict[str, float | int | str]:
        return {"name": self.name, "gpus": self.gpus, "peak_flops_per_gpu": self.peak_flops,
                "hbm_bytes_per_s_per_gpu": self.hbm_bytes_per_s, "compute_efficiency": self.compute_efficiency,
                "bandwidth_efficiency": self.bandwidth_efficiency, "step_overhead_s": self.step_overhead_s,
                "active_params": self.active_params, "weights_read_per_step_bytes": self.dense_bytes,
                "expert_bytes": self.expert_bytes, "weight_bytes_per_param": 1, "kv_bytes_per_element": 2}


FEATURES = ("prefill_tokens", "prefill_attended", "decode_rows", "decode_context")


@dataclass(frozen=True)
class LinearCost:
    """t = intercept + sum(coefficient x feature) over FEATURES, fitted."""

    name: str
    intercept: float
    coefficients: tuple[float, ...]

    def step_seconds(self, s: StepShape) -> float:
        if s.rows == 0:
            return 0.0
        return max(0.0, self.intercept + sum(c * getattr(s, f) for c, f in zip(self.coefficients, FEATURES)))

    @classmethod
    def fit(cls, samples: Seq[tuple[StepShape, float]], name: str = "calibrated") -> LinearCost:
        import numpy as np

        x = np.array([[1.0, *(float(getattr(s, f)) for f in FEATURES)] for s, _ in samples])
        y = np.array([t for _, t in samples])
        # Non-negative least squares by clipping and refitting: a negative cost
        # per token would let a longer step look cheaper.
        keep = list(range(x.shape[1]))
        while True:
            coef = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
            bad = [k for k, c in zip(keep, coef) if c < 0 and k != 0]
            if not bad:
                break
            keep = [k for k in keep if k not in bad]
        full = [0.0] * x.shape[1]
        for k, c in zip(keep, coef):
            full[k] = float(c)
        return cls(name, full[0], tuple(full[1:]))

    def describe(self) -> dict[str, float | str]:
        return {"name": self.name, "intercept_s": self.intercept,
                **{f"{f}_s": c for f, c in zip(FEATURES, self.coefficients)}}
