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

from llm_core.config import ModelConfig


def _dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = weight.shape
    per_element = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.to(torch.float32) * per_element.to(torch.float32)


def write_dequantized_copy(src: str | Path, dst: str | Path) -> Path:
    """``src``'s weights as float32 (FP8 ones times their block scales, a fused
    qkv_proj split into q, k and v), config and tokenizer alongside."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    quant = config.pop("quantization_config")
    block = tuple(quant["weight_block_size"])
    fused = config.pop("attention_projection_layout", None) == "fused_qkv"
    model_config = ModelConfig.from_hf_dict(config)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[name.removesuffix("weight") + "weight_scale_inv"]
            if name.endswith("qkv_proj.weight"):
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
