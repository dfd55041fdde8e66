"""What media a checkpoint takes, read from its config.json alone: the
encoders it declares and their placeholder tokens. The API process decides
what a request may carry from these without loading an encoder (or torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llm_core.loading.errors import CheckpointError

__all__ = ["encoder_kinds", "media_kinds", "placeholder_token_ids", "read_config_json"]

_TOKEN_ID_KEYS = {"image": "image_token_id", "video": "video_token_id", "audio": "audio_token_id"}


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir} has no config.json") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def placeholder_token_ids(model_dir: str | Path) -> dict[str, int]:
    """Placeholder id per media kind the checkpoint declares (empty for a text model)."""
    config = read_config_json(model_dir)
    return {kind: int(config[key]) for kind, key in _TOKEN_ID_KEYS.items() if config.get(key) is not None}


def encoder_kinds(model_dir: str | Path) -> frozenset[str]:
    """The encoders the checkpoint's config.json declares ("vision", "audio"), without loading them."""
    config = read_config_json(model_dir)
    return frozenset(kind for kind, key in (("vision", "vision_config"), ("audio", "audio_config")) if key in config)


def media_kinds(encoder_kinds: set[str] | frozenset[str], placeholder_ids: dict[str, int]) -> frozenset[str]:
    """Media kinds a model takes: those with an encoder and a placeholder token."""
    kinds = set()
    if "vision" in encoder_kinds:
        kinds |= {"image", "video"}
    if "audio" in encoder_kinds:
        kinds.add("audio")
    return frozenset(k for k in kinds if k in placeholder_ids)
