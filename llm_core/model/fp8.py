"""FP8 (e4m3) weights: the checkpoint format and the math of its scales.

The MiMo-V2 checkpoints Xiaomi publishes use the DeepSeek-V3 "fine-grained
FP8" format: each quantized matrix ``W [N, K]`` is stored as
``float8_e4m3fn`` next to a float32 ``weight_scale_inv`` with one value per
``block = (bn, bk)`` tile, and ``W ≈ fp8[i, j] * scale_inv[i // bn, j // bk]``
(the name says "inverse", the value multiplies). The last tiles may be
partial: the scale grid is ``[ceil(N / bn), ceil(K / bk)]``. Other FP8 exports
store one float32 ``weight_scale`` per matrix (``W ≈ fp8 * weight_scale``) and,
with a static activation scheme, an ``input_scale`` per matrix.

``config.json`` says which by its ``quantization_config``; ``Fp8Scheme``
is what this engine understands of it, and anything else is a ``ConfigError``.
Nothing here reads files or picks devices: the loader (``weights.py``) and the
FP8 modules (``fp8_linear.py``) do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from llm_core.model.config import ConfigError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK_SCALE_SUFFIX = "weight_scale_inv"
TENSOR_SCALE_SUFFIX = "weight_scale"
# Block sides a kernel tiles by: one scale per tile of the product.
_BLOCK_SIDES = tuple(2**p for p in range(4, 11))
ActivationScheme = Literal["dynamic", "static"]

# Parameters that stay unquantized in every FP8 export of this family, whatever
# the config lists: embeddings, the LM head, norms, sinks, the router and its
# bias (float32 in every public loader), biases, and the MTP layers' eh_proj.
_NEVER_QUANTIZED = re.compile(
    r"(^|\.)(embed_tokens|lm_head|eh_proj)\.weight$"
    r"|norm\.weight$"
    r"|\.mlp\.gate\.(weight|e_score_correction_bias)$"
    r"|\.(sinks|attention_sink_bias)$"
    r"|\.bias$"
)


@dataclass(frozen=True)
class Fp8Scheme:
    """An FP8 checkpoint's quantization, as its ``quantization_config`` states it."""

    # (rows, columns) of weight per scale; None: one scale per matrix.
    block: tuple[int, int] | None
    activation_scheme: ActivationScheme = "dynamic"
    # Module names kept unquantized (``ignored_layers`` as vLLM reads it,
    # ``modules_to_not_convert`` as transformers does).
    not_converted: tuple[str, ...] = ()

    @property
    def scale_suffix(self) -> str:
        return BLOCK_SCALE_SUFFIX if self.block is not None else TENSOR_SCALE_SUFFIX

    def lists_unconverted(self, module: str) -> bool:
        """Whether the config names ``module`` (e.g. ``model.layers.3.self_attn.o_proj``)
        as kept unquantized: an entry matches the module itself, a module it
        contains, or a trailing part of its name at a ``.`` boundary."""
        return any(module == entry or module.startswith(entry + ".") or module.endswith("." + entry)
                   for entry in self.not_converted)

    def describe(self) -> str:
        return f"fp8 e4m3, {self.block[0]}x{self.block[1]} blocks" if self.block else "fp8 e4m3, per tensor"

    def to_hf_dict(self) -> dict[str, Any]:
        """``quantization_config`` as the published checkpoints spell it."""
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": self.activation_scheme}
        if self.block is not None:
            out["weight_block_size"] = list(self.block)
        if self.not_converted:
            out["ignored_layers"] = list(self.not_converted)
        return out


def never_quantized(param_name: str) -> bool:
    """Parameters no FP8 export of the family quantizes (see ``_NEVER_QUANTIZED``)."""
    return bool(_NEVER_QUANTIZED.search(param_name))


def read_fp8_scheme(config_json: dict[str, Any]) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme, None for an unquantized checkpoint; a
    ``ConfigError`` for any quantization this engine does not understand."""
    quant = config_json.get("quantization_config")
    if quant is None:
        if "compression_config" in config_json:
            raise ConfigError("config.json has a 'compression_config' (compressed-tensors): not supported; "
                              "only quantization_config with quant_method 'fp8' is")
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported (only 'fp8')")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3', float8_e4m3fn)")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"quantization_config.activation_scheme {scheme!r} is not 'dynamic' or 'static'")
    scale_fmt = quant.get("scale_fmt")
    if scale_fmt not in (None, "float"):
        raise ConfigError(f"quantization_config.scale_fmt {scale_fmt!r} is not supported (only float32 scales)")
    block = read_block(quant.get("weight_block_size"))
    if block is not None and scheme != "dynamic":
        raise ConfigError("block-quantized FP8 (weight_block_size) needs activation_scheme 'dynamic'")
    not_converted: list[str] = []
    for key in ("ignored_layers", "modules_to_not_convert"):
        entries = quant.get(key) or []
        if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
            raise ConfigError(f"quantization_config.{key} must be a list of module names, got {entries!r}")
        not_converted += [e for e in entries if e not in not_converted]
    return Fp8Scheme(block, scheme, tuple(not_converted))


def read_block(value: Any) -> tuple[int, int] | None:
    """A ``weight_block_size`` this engine tiles by, or a ``ConfigError``."""
    if value is None:
        return None
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value))
    if not ok or any(v not in _BLOCK_SIDES for v in value):
        raise ConfigError(f"quantization_config.weight_block_size {value!r} is not supported: two sides, each a "
                          f"power of two from {_BLOCK_SIDES[0]} to {_BLOCK_SIDES[-1]} (the published one is [128, 128])")
    return value[0], value[1]


# ------------------------------------------------------------------ the math
# An FP8 matrix everywhere past the loader: values [..., N, K] float8_e4m3fn, a
# float32 scale table [..., S, ceil(K / group_k)] and the table row of each of
# the N rows (int32 [N]). A plain block-quantized matrix has row n on table row
# n // bn; rows gathered from several blocked parts (gate | up, the q, k and v
# rows of a fused projection) point at their own part's rows, and a per-tensor
# scale is a one-row table. Values are never requantized on the way.
DEFAULT_GROUP = 128  # the K group of per-tensor weights' activations


def block_scale_rows(rows: int, block_rows: int, first: int = 0) -> torch.Tensor:
    """Table rows of a plain blocked matrix's rows, from table row ``first``."""
    return (torch.arange(rows, dtype=torch.int32) // block_rows + first).to(torch.int32)


def dequantize(values: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, group_k: int) -> torch.Tensor:
    """float32 values of an FP8 matrix: e4m3 values (exact in float32) times
    their scale, one rounding per element."""
    k = values.shape[-1]
    per_element = scale.to(torch.float32)[..., scale_row.long(), :].repeat_interleave(group_k, dim=-1)[..., :k]
    return values.to(torch.float32) * per_element


def quantize_blockwise(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [..., N, K], float32 scale_inv [..., ceil(N/bn), ceil(K/bk)]) with each
    tile's largest magnitude at the e4m3 maximum: what FP8 exporters write."""
    w = weight.to(torch.float32)
    rows, cols = w.shape[-2:]
    bn, bk = block
    padded = torch.nn.functional.pad(w, (0, -cols % bk, 0, -rows % bn))
    tiles = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., nb, bn, kb, bk]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).contiguous()
    per_element = scale[..., block_scale_rows(rows, bn).long(), :].repeat_interleave(bk, dim=-1)[..., :cols]
    return (w / per_element).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_tensorwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8, float32 scalar scale) with the largest magnitude at the e4m3 maximum."""
    w = weight.to(torch.float32)
    amax = w.abs().max()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(())


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantization of activations [M, K]: (fp8 [M, K],
    float32 scales [M, ceil(K/group)]), each group's largest magnitude at the
    e4m3 maximum. A partial last group is scaled by what it holds."""
    m, k = x.shape
    groups = torch.nn.functional.pad(x.to(torch.float32), (0, -k % group)).view(m, -1, group)
    scale = groups.abs().amax(dim=-1).clamp_min(1e-10) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k].to(FP8_DTYPE)
    return q, scale


def fp8_matmul_reference(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor,
                         group_k: int) -> torch.Tensor:
    """float32 ``dequant(quantize_activations(x)) @ dequant(W).T``: what the FP8
    GEMM computes, up to summation order (for tests)."""
    x_q, x_scale = quantize_activations(x, group_k)
    x_values = x_q.to(torch.float32) * x_scale.repeat_interleave(group_k, dim=-1)[:, : x.shape[1]]
    return x_values @ dequantize(values, scale, scale_row, group_k).T
