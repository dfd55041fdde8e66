"""Building blocks of the MiMo-V2 model: norm, rotary embedding, MLP, MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llm_core.model.config import AttentionSpec, ModelConfig
from llm_core.model.expert_parallel import ExpertParallel, sharded_moe


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the activation dtype, as the reference does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, spec: AttentionSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [T, rotary_dim] for the given positions.

    One frequency theta^(-i/d) per even i in [0, d), d = ``spec.rope_dim``,
    each used by a pair of channels: an odd d yields d + 1 columns, as in
    transformers. Recomputed per forward (a few hundred flops per token) so
    the model holds no buffers that depend on the device it was loaded to.
    """
    dim = spec.rope_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim
    inv_freq = 1.0 / (spec.rope_theta**exponent)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [T, heads, head_dim]; pass the rest."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated_half = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    x_rot = x_rot * cos[:, None, :] + rotated_half * sin[:, None, :]
    return torch.cat((x_rot, x_pass), dim=-1)


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    """Sigmoid router with score-correction bias and group-limited top-k."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        # Router weights and bias stay float32 even in low-precision models.
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(self.num_experts), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, k], expert ids [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
            expert_mask = group_mask.repeat_interleave(self.num_experts // self.n_group, dim=-1)
            choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, expert_ids


class RoutedExperts(nn.Module):
    """All experts of a layer as stacked tensors (one gather per expert hit)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @classmethod
    def over(cls, gate_up: torch.Tensor, down: torch.Tensor) -> RoutedExperts:
        """Experts whose weights are the given tensors (no copy): what the opaque op runs eagerly."""
        experts = cls(0, 0, 0)
        experts.num_experts = gate_up.shape[0]
        experts.gate_up_proj, experts.down_proj = nn.Parameter(gate_up, requires_grad=False), nn.Parameter(
            down, requires_grad=False)
        return experts

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        if not torch.is_grad_enabled() and _cpu_kernel_runs(x, self.gate_up_proj, self.down_proj):
            # Traced or not: one opaque C++ op over each expert's own tokens.
            return torch.ops.swallow_cpu.routed_experts(x, weights, expert_ids, self.gate_up_proj, self.down_proj)
        if torch.compiler.is_compiling() or _capturing(x):
            # Traced or captured: no host sync, no data-dependent shape.
            if _grouped_mm_traces(x, self.gate_up_proj, self.down_proj):
                return self._grouped(x, weights, expert_ids)
            if x.shape[0] <= _DENSE_TOKENS or _capturing(x):
                return self._dense(x, weights, expert_ids)
            # A prefill chunk: the eager products as one opaque op (not captured).
            return torch.ops.swallow.routed_experts(x, weights, expert_ids, self.gate_up_proj, self.down_proj)
        # Training keeps the dispatched path: its backward is plain autograd everywhere.
        if not torch.is_grad_enabled() and _grouped_mm_runs(x, self.gate_up_proj, self.down_proj):
            return self._grouped(x, weights, expert_ids)
        return self._dispatched(x, weights, expert_ids)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Slots sorted by expert through one grouped product per projection, the
        group boundaries staying on the device: nothing here waits on the host."""
        flat_ids = expert_ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        token_of = order // expert_ids.shape[1]
        # A scatter rather than bincount: its output size is static, so it traces.
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        ends = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x[token_of], self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        h = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        slot_weights = weights.reshape(-1)[order, None].to(h.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, h * slot_weights)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by a dense [T, experts] routing
        matrix (zero where not chosen): experts / top_k times the useful flops,
        but static shapes, for traced forwards where grouped products do not
        trace (CPU float32). Few experts per token and small batches are where
        it is used: decode of small models."""
        route = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        route.scatter_(1, expert_ids, weights.to(x.dtype))
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
        h = torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # [E, T, H]
        return torch.einsum("eth,te->th", h, route)

    def _dispatched(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Where grouped products do not run: sized from the expert counts on the host."""
        num_slots = expert_ids.numel()
        flat_ids = expert_ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        sorted_ids = flat_ids[order]
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        token_of = order // expert_ids.shape[1]
        slot_weights = weights.reshape(-1)[order, None]
        widest = int(counts.max())
        if self.num_experts * widest <= 2 * num_slots:
            # Tokens spread evenly (small batches, decode): one padded batched
            # product over all experts beats a Python loop over them.
            rank = torch.arange(num_slots, device=x.device) - (counts.cumsum(0) - counts)[sorted_ids]
            packed = x.new_zeros(self.num_experts, widest, x.shape[1])
            packed[sorted_ids, rank] = x[token_of]
            gate, up = torch.bmm(packed, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
            h = torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))[sorted_ids, rank]
            return torch.zeros_like(x).index_add_(0, token_of, h * slot_weights.to(h.dtype))
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, h * slot_weights[start : start + count].to(h.dtype))
            start += count
        return out


def empty_k_major(experts: int, rows: int, k: int, *, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised [E, rows, k] tensor stored as [E, k, rows]: the layout
    the C++ experts kernel reads each expert's product in."""
    return torch.empty(experts, k, rows, dtype=dtype, device=device).transpose(1, 2)


def k_major(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [E, rows, k] unchanged in value, in ``empty_k_major``'s layout."""
    return empty_k_major(*weight.shape, dtype=weight.dtype, device=weight.device).copy_(weight)


def _cpu_kernel_runs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the C++ experts kernel (``cpu_kernels.routed_experts_cpu``) takes
    this layer: float32 on the CPU, experts stored k-major -- which the CPU
    loader does only where the kernel is built."""
    return (x.device.type == "cpu" and x.dtype == gate_up.dtype == down.dtype == torch.float32
            and gate_up.stride(1) == 1 and down.stride(1) == 1)


def _grouped_mm_runs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: on CPU float32 or
    bfloat16 (its fallback), on CUDA bfloat16 only; rows and data 16-byte
    aligned (weights loaded as views into a file buffer may not be)."""
    if x.device.type == "cpu":
        ok_dtype = x.dtype in (torch.float32, torch.bfloat16)
    else:
        ok_dtype = x.device.type == "cuda" and x.dtype == torch.bfloat16
    if not ok_dtype or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        return False
    aligned = 16 // x.element_size()
    hidden, intermediate = gate_up.shape[-1], down.shape[-1]
    return (hidden % aligned == 0 and intermediate % aligned == 0
            and gate_up.data_ptr() % 16 == 0 and down.data_ptr() % 16 == 0)


# Traced batches up to this many tokens compute every expert densely (decode);
# larger ones (prefill chunks) call the eager products as one opaque op.
_DENSE_TOKENS = 256


@torch.library.custom_op("swallow::routed_experts", mutates_args=())
def _routed_experts_op(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor) -> torch.Tensor:
    return RoutedExperts.over(gate_up, down)(x, weights, expert_ids)


@_routed_experts_op.register_fake
def _(x: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(x)


def _grouped_mm_traces(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can be traced here: its fake kernel takes
    bfloat16 only. Loaded and initialised weights are 64-byte aligned, so
    (unlike ``_grouped_mm_runs``) no pointer is inspected, which would not trace."""
    if not (x.device.type == "cuda" and x.dtype == torch.bfloat16 and gate_up.dtype == down.dtype == x.dtype):
        return False
    return gate_up.shape[-1] % 8 == 0 and down.shape[-1] % 8 == 0  # 16-byte rows


def _capturing(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = RoutedExperts(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        )
        # Set by ``shard``: ``experts`` is then this rank's block of the group's.
        self.ep: ExpertParallel | None = None

    def shard(self, ep: ExpertParallel) -> None:
        """Keep only the routed experts ``ep``'s rank owns (the router stays
        whole). On the meta device before loading, nothing is allocated."""
        owned = ep.experts(self.gate.num_experts)
        part = slice(owned.start, owned.stop)
        # Clones, so that the full tensors are freed with the old module.
        self.experts = RoutedExperts.over(self.experts.gate_up_proj[part].clone(),
                                          self.experts.down_proj[part].clone())
        self.ep = ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep is not None and self.ep.size > 1:
            return sharded_moe(x, self.gate, self.experts, self.ep)
        weights, expert_ids = self.gate(x)
        return self.experts(x, weights, expert_ids)
