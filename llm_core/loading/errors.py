"""The loader's error, apart from the loader: code that only reads a
checkpoint's config.json (what media a model takes) raises it without
importing torch."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match its config."""
