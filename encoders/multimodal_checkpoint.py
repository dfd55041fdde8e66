"""A multimodal checkpoint: the LLM plus its vision and audio towers in one directory.

Layout (Hugging Face style, loadable piece by piece):

- ``config.json``: the LLM config, plus ``vision_config`` (Qwen2.5-VL vision
  fields), ``audio_config`` (Whisper fields + projector), and the placeholder
  ids ``image_token_id`` / ``video_token_id`` / ``audio_token_id``;
- safetensors: LLM tensors, ``visual.*``, ``audio_tower.*``, ``audio_projector.*``;
- ``tokenizer.json`` with the chat special tokens, ``tokenizer_config.json``
  with the chat template, ``preprocessor_config.json`` with image/video sizes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from encoders.audio import AudioEncoder, AudioEncoderConfig, load_audio_encoder
from encoders.media_kinds import read_config_json
from encoders.vision import VisionEncoder, VisionEncoderConfig, load_vision_encoder
from llm_core.model.chat import DEFAULT_CHAT_TEMPLATE, MEDIA_PLACEHOLDERS, MULTIMODAL_SPECIAL_TOKENS
from llm_core.loading.checkpoint import SPECIAL_TOKENS, write_random_checkpoint
from llm_core.model.config import ModelConfig
from llm_core.model.tokenizer import Tokenizer
from llm_core.loading.weights import INDEX_FILE, CheckpointError

__all__ = ["add_encoders", "load_encoders", "write_random_multimodal_checkpoint"]

ENCODER_SHARD = "encoders.safetensors"


def load_encoders(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, VisionEncoder | AudioEncoder]:
    """The encoders the checkpoint's config.json declares, by encoder kind."""
    config = read_config_json(model_dir)
    encoders: dict[str, VisionEncoder | AudioEncoder] = {}
    if "vision_config" in config:
        encoders["vision"] = load_vision_encoder(model_dir, dtype=dtype, device=device)
    if "audio_config" in config:
        encoders["audio"] = load_audio_encoder(model_dir, dtype=dtype, device=device)
    hidden = config.get("hidden_size")
    for kind, encoder in encoders.items():
        out = encoder.config.out_hidden_size
        if out != hidden:
            raise CheckpointError(f"the {kind} encoder projects to {out}, but the LLM hidden size is {hidden}")
    return encoders


def init_encoder_weights(module: nn.Module, generator: torch.Generator) -> None:
    """Seeded weights with unit-scale activations, so random encoders give varied embeddings."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() == 1:
                param.copy_(torch.ones_like(param) if "norm" in name or "ln_" in name else torch.zeros_like(param))
            else:
                fan_in = math.prod(param.shape[1:])
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))


def write_random_multimodal_checkpoint(
    out_dir: str | Path,
    llm: ModelConfig,
    vision: VisionEncoderConfig | None,
    audio: AudioEncoderConfig | None,
    *,
    seed: int = 0,
    preprocessor: dict[str, Any] | None = None,
    fp8_block: tuple[int, int] | None = None,
    fused_qkv: bool = False,
) -> Path:
    """An LLM with random weights and random encoders, wired as a chat model
    (``fp8_block``, ``fused_qkv``: the LLM's as ``write_random_checkpoint`` writes them)."""
    special = [*SPECIAL_TOKENS, *MULTIMODAL_SPECIAL_TOKENS]
    out = write_random_checkpoint(out_dir, llm, seed, special_tokens=special, fp8_block=fp8_block,
                                  fused_qkv=fused_qkv)
    generator = torch.Generator().manual_seed(seed + 1)
    vision_encoder = audio_encoder = None
    if vision is not None:
        vision_encoder = VisionEncoder(vision)
        init_encoder_weights(vision_encoder, generator)
    if audio is not None:
        audio_encoder = AudioEncoder(audio)
        init_encoder_weights(audio_encoder, generator)
    add_encoders(out, vision_encoder, audio_encoder, preprocessor or {})
    return out


def add_encoders(
    out: Path,
    vision: VisionEncoder | None,
    audio: AudioEncoder | None,
    preprocessor: dict[str, Any],
    chat_template: str = DEFAULT_CHAT_TEMPLATE,
) -> None:
    """Turn a saved LLM checkpoint (with a tokenizer holding the chat special tokens)
    into a multimodal one: encoder tensors, configs, placeholder ids, chat template."""
    tokenizer = Tokenizer(out / "tokenizer.json")
    ids = {kind: tokenizer.token_to_id(token) for kind, token in MEDIA_PLACEHOLDERS.items()}
    config = json.loads((out / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    if vision is not None:
        tensors |= {f"visual.{k}": v for k, v in vision.state_dict().items()}
        config["vision_config"] = vision.config.to_hf_dict()
        config["image_token_id"], config["video_token_id"] = ids["image"], ids["video"]
    if audio is not None:
        tensors |= {f"audio_tower.{k}": v for k, v in audio.tower.state_dict().items()}
        if audio.projector is not None:
            tensors |= {f"audio_projector.{k}": v for k, v in audio.projector.state_dict().items()}
        config["audio_config"] = audio.config.to_hf_dict()
        config["audio_token_id"] = ids["audio"]
    config["eos_token_id"] = tokenizer.token_to_id("<|im_end|>")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _add_shard(out, {k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    tokenizer_config = {"chat_template": chat_template, "eos_token": "<|im_end|>", "pad_token": "<pad>"}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))


def _add_shard(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    if not tensors:
        return
    save_file(tensors, str(out / ENCODER_SHARD), metadata={"format": "pt"})
    index = json.loads((out / INDEX_FILE).read_text())
    index["weight_map"].update(dict.fromkeys(tensors, ENCODER_SHARD))
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
