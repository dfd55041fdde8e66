"""An FP8 checkpoint as float32 files, written without this engine's loader.

It reads the tensors with the safetensors library and applies the format's
definition (``W = fp8 * scale_inv`` per block, a fused ``qkv_proj`` cut into
its q, k and v rows chunk by chunk) with nothing shared with ``weights.py``:
what FP8 loading is checked against (transformers runs the copy), and a way
to hand the weights to a tool that does not read FP8."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llm_core.model.config import ModelConfig


def _dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """fp8 [..., rows, cols] times its scale: one per block tile, or one per tensor
    (per expert of a stacked tensor when the scale has one value each)."""
    values = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    if block is None:
        return values * (scale.reshape(-1, 1, 1) if scale.numel() > 1 else scale.reshape(()))
    rows, cols = weight.shape[-2:]
    per_element = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)
    return values * per_element[..., :cols]


def _scale_of(name: str, suffix: str) -> str:
    """``X.weight`` -> ``X.<suffix>``; a stacked ``X.gate_up_proj`` -> ``X.gate_up_proj_<suffix minus weight_>``."""
    if name.endswith(".weight"):
        return name.removesuffix("weight") + suffix
    return f"{name}_{suffix.removeprefix('weight_')}"


def write_dequantized_copy(src: str | Path, dst: str | Path) -> Path:
    """``src``'s weights as float32 (FP8 ones times their block or per-tensor
    scales, a fused qkv_proj split into q, k and v; activation and KV scales
    left out), config and tokenizer alongside."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    quant = config.pop("quantization_config")
    block = tuple(quant["weight_block_size"]) if quant.get("weight_block_size") else None
    suffix = "weight_scale_inv" if block else "weight_scale"
    fused = config.pop("attention_projection_layout", None) == "fused_qkv"
    model_config = ModelConfig.from_hf_dict(config)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    scales = {_scale_of(name, suffix) for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in scales or name.endswith(("input_scale", "k_scale", "v_scale", "kv_scale")):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[_scale_of(name, suffix)]
            if name.endswith("qkv_proj.weight"):
                assert block is not None, "a fused qkv_proj is block-quantized"
                out |= _split_qkv(name, tensor, scale, block, fused, model_config)
                continue
            tensor = _dequantize(tensor, scale, block)
        out[name] = tensor.to(torch.float32)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}, indent=2))
    for extra in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    return dst


def _split_qkv(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], fused: bool,
               config: ModelConfig) -> dict[str, torch.Tensor]:
    assert fused, f"{name} in a checkpoint that does not declare attention_projection_layout fused_qkv"
    parts = name.split(".")
    mtp = parts[1] == "mtp"
    spec = config.sliding_attention if mtp else config.attention(int(parts[2]))
    chunks = config.full_attention.num_kv_heads
    rows = weight.shape[0] // chunks
    scale_rows = scale.shape[0] // chunks
    dense = [_dequantize(weight[c * rows:(c + 1) * rows], scale[c * scale_rows:(c + 1) * scale_rows], block)
             for c in range(chunks)]
    sizes = [spec.num_heads * spec.head_dim // chunks, spec.num_kv_heads * spec.head_dim // chunks,
             spec.num_kv_heads * spec.v_head_dim // chunks]
    q, k, v = (torch.cat(group) for group in zip(*(chunk.split(sizes) for chunk in dense)))
    prefix = name.removesuffix("qkv_proj.weight")
    return {f"{prefix}q_proj.weight": q, f"{prefix}k_proj.weight": k, f"{prefix}v_proj.weight": v}
