"""Modules whose weights stay FP8 in memory: a linear layer and the routed experts.

They replace ``nn.Linear`` / ``RoutedExperts`` where the loader keeps a
checkpoint's FP8 weights resident (CUDA with FP8 tensor cores, or the Triton
interpreter on request), with the same call signatures, so the model has one
implementation whatever its weights hold. Each keeps its matrix as
``fp8.py`` describes: e4m3 values, a float32 scale table and the table row of
every weight row. Products go through the block-scaled FP8 GEMMs of
``triton_fp8`` (imported on first use, so ``TRITON_INTERPRET`` can still be
set before it), as custom ops when traced.
"""

from __future__ import annotations

import torch
from torch import nn

from llm_core.model.config import ModelConfig
from llm_core.model.fp8 import FP8_DTYPE, Fp8Scheme, never_quantized
from llm_core.model.meta_build import meta_build


def _kernels():  # noqa: ANN202 - the module
    from llm_core.model import triton_fp8
    return triton_fp8


class Fp8Linear(nn.Module):
    """``nn.Linear`` with an FP8 weight: ``x @ W.T + b`` with x quantized per
    token and ``group_k`` group on the fly."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scale_rows: int, group_k: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_k = in_features, out_features, group_k
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_rows, -(-in_features // group_k)),
                                             requires_grad=False)
        self.register_buffer("weight_scale_row", torch.empty(out_features, dtype=torch.int32))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.swallow.fp8_linear(x, self.weight, self.weight_scale_inv, self.weight_scale_row,
                                                self.group_k, self.bias)
        return _kernels().block_fp8_linear(x, self.weight, self.weight_scale_inv, self.weight_scale_row,
                                           self.group_k, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8, group_k={self.group_k}"


class Fp8RoutedExperts(nn.Module):
    """``RoutedExperts`` with FP8 weights: one grouped FP8 product per projection
    over every expert's tokens."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, gate_up_scale_rows: int,
                 down_scale_rows: int, group_k: int) -> None:
        super().__init__()
        self.num_experts, self.group_k = num_experts, group_k
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=FP8_DTYPE), requires_grad=False)
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(e, gate_up_scale_rows, -(-h // group_k)),
                                                   requires_grad=False)
        self.register_buffer("gate_up_proj_scale_row", torch.empty(2 * i, dtype=torch.int32))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=FP8_DTYPE), requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(torch.empty(e, down_scale_rows, -(-i // group_k)),
                                                requires_grad=False)
        self.register_buffer("down_proj_scale_row", torch.empty(h, dtype=torch.int32))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        args = (x, weights, expert_ids, self.gate_up_proj, self.gate_up_proj_scale_inv, self.gate_up_proj_scale_row,
                self.down_proj, self.down_proj_scale_inv, self.down_proj_scale_row, self.group_k)
        if torch.compiler.is_compiling():
            return torch.ops.swallow.fp8_experts(*args)
        return _kernels().grouped_block_fp8_experts(*args)


@torch.library.custom_op("swallow::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor,
                   group_k: int, bias: torch.Tensor | None) -> torch.Tensor:
    return _kernels().block_fp8_linear(x, weight, scale, scale_row, group_k, bias)


@_fp8_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, *_: object) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("swallow::fp8_experts", mutates_args=())
def _fp8_experts_op(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_scale: torch.Tensor, gate_up_scale_row: torch.Tensor, down: torch.Tensor,
                    down_scale: torch.Tensor, down_scale_row: torch.Tensor, group_k: int) -> torch.Tensor:
    return _kernels().grouped_block_fp8_experts(x, weights, expert_ids, gate_up, gate_up_scale, gate_up_scale_row,
                                                down, down_scale, down_scale_row, group_k)


@_fp8_experts_op.register_fake
def _(x: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(x)


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether this device runs the FP8 GEMMs at speed: CUDA with FP8 tensor
    cores (compute capability 8.9 and up)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers take where they live."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def published_fp8_scheme(config: ModelConfig, block: tuple[int, int] = (128, 128)) -> Fp8Scheme:
    """How Xiaomi's MiMo-V2 checkpoints are quantized: every large matrix in
    ``block`` tiles but each layer's ``self_attn.o_proj`` (``ignored_layers``),
    and what ``never_quantized`` names."""
    layers = [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    layers += [f"model.mtp.layers.{j}" for j in range(config.num_mtp_layers)]
    return Fp8Scheme(block, "dynamic", tuple(f"{layer}.self_attn.o_proj" for layer in layers))


def model_on_meta(config: ModelConfig, scheme: Fp8Scheme | None, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model as the loader holds it, on the meta device (resident bytes
    without memory): the router float32, the rest in ``dtype``, but with
    ``scheme`` its matrices as an FP8 checkpoint of it keeps them (values,
    scale tables, scale rows)."""
    from llm_core.model.layers import RoutedExperts, TopKRouter
    from llm_core.model.model import MiMoV2ForCausalLM

    with meta_build():
        model = MiMoV2ForCausalLM(config).to(dtype)
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.float()
    if scheme is None:
        return model
    assert scheme.block is not None, "a block-quantized scheme"
    rows, group = scheme.block
    with meta_build():
        for name, module in list(model.named_modules()):
            owner_name, _, attr = name.rpartition(".")
            if isinstance(module, nn.Linear):
                if never_quantized(f"{name}.weight") or scheme.lists_unconverted(name):
                    continue
                fp8: nn.Module = Fp8Linear(module.in_features, module.out_features, module.bias is not None,
                                           -(-module.out_features // rows), group)
            elif isinstance(module, RoutedExperts):
                hidden, inter = module.gate_up_proj.shape[2], module.down_proj.shape[2]
                fp8 = Fp8RoutedExperts(module.num_experts, hidden, inter, 2 * -(-inter // rows), -(-hidden // rows),
                                       group)
            else:
                continue
            setattr(model.get_submodule(owner_name), attr, fp8)
    return model
