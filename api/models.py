"""The checkpoints `swallow` serves without being told one: the committed
demo model, else a small random multimodal one written on first use."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llm_core.model.config import ModelConfig


# The trained demo model, committed with the code (`swallow train-demo` rebuilds it).
DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "demo"


def default_model_dir() -> Path:
    """Where `swallow serve` finds (or first writes) its fallback random model."""
    home = Path(os.environ.get("SWALLOW_HOME", Path.home() / ".cache" / "swallow"))
    return home / "models" / "tiny-random-multimodal"


def write_random_multimodal(out: str | Path, config: ModelConfig, seed: int = 0,
                            fp8_block: tuple[int, int] | None = None, fused_qkv: bool = False) -> Path:
    """The LLM of ``config`` with the demo-size encoders projecting to its hidden size
    (``fp8_block``: the LLM's weights FP8 as published; the encoders stay float)."""
    import dataclasses

    from encoders.multimodal_checkpoint import write_random_multimodal_checkpoint
    from encoders.presets import DEMO_AUDIO, DEMO_PREPROCESSOR_CONFIG, DEMO_VISION

    return write_random_multimodal_checkpoint(
        out,
        config,
        dataclasses.replace(DEMO_VISION, out_hidden_size=config.hidden_size),
        dataclasses.replace(DEMO_AUDIO, out_hidden_size=config.hidden_size),
        seed=seed,
        preprocessor=DEMO_PREPROCESSOR_CONFIG,
        fp8_block=fp8_block,
        fused_qkv=fused_qkv,
    )


def ensure_default_model() -> Path:
    """The committed demo model if this checkout has it, else the fallback random one (written on first use)."""
    from llm_core.model.presets import tiny

    if (DEMO_MODEL_DIR / "config.json").exists():
        return DEMO_MODEL_DIR
    path = default_model_dir()
    if not (path / "config.json").exists():
        print(f"no --model given: writing a small random multimodal checkpoint to {path}", flush=True)
        write_random_multimodal(path, tiny(), seed=0)
    return path
