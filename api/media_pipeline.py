"""A multimodal checkpoint's encoders in the process that serves media: the
encoders batched across requests behind a ``MediaEmbedder`` that decodes,
preprocesses and caches. ``serve``'s API process and a stack's encoder build
it alike; a text-only checkpoint gets none, and imports no torch for it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api.chat import MediaRef
from api.metrics import ServerMetrics
from api.options import ServerOptions
from encoders.media_kinds import encoder_kinds
from llm_core.model.multimodal import MediaEmbedding
from media import VIDEO_PREPROCESS, MediaLimits, VisionPreprocessConfig

if TYPE_CHECKING:
    from embedding_cache import EmbeddingCache, MediaEmbedder, MediaEmbedderConfig, SharedEmbeddingStore
    from encoders import EncoderBatcher

__all__ = ["LocalEmbedder", "LocalMedia", "build_media", "media_config", "media_pipeline"]


def media_config(model_dir: Path, limits: MediaLimits, device: str = "cpu") -> MediaEmbedderConfig:
    """Image/video preprocessing from ``preprocessor_config.json`` (Qwen2-VL field names,
    plus ``video_min_pixels``/``video_max_pixels``/``video_fps``/``video_max_frames``),
    run on ``device``, the encoders'."""
    # Imported here: the embedder brings media decoding (torchvision), which a
    # text-only model's server never needs.
    from embedding_cache import MediaEmbedderConfig

    path = model_dir / "preprocessor_config.json"
    raw: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    shared = {
        k: (tuple(raw[k]) if isinstance(raw[k], list) else raw[k])
        for k in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std")
        if k in raw
    }
    base = VisionPreprocessConfig(**shared)
    image = VisionPreprocessConfig(
        **shared,
        min_pixels=raw.get("min_pixels", base.min_pixels),
        max_pixels=raw.get("max_pixels", base.max_pixels),
    )
    video = VisionPreprocessConfig(
        **shared,
        min_pixels=raw.get("video_min_pixels", VIDEO_PREPROCESS.min_pixels),
        max_pixels=raw.get("video_max_pixels", VIDEO_PREPROCESS.max_pixels),
    )
    return MediaEmbedderConfig(
        image=image,
        video=video,
        video_fps=float(raw.get("video_fps", 2.0)),
        video_max_frames=int(raw.get("video_max_frames", 64)),
        limits=limits,
        preprocess_device=device,
    )


class LocalEmbedder:
    """Media embedded in this process; the rows stay here too."""

    def __init__(self, embedder: MediaEmbedder) -> None:
        self.media = embedder

    async def embed(self, ref: MediaRef) -> MediaEmbedding:
        return await self.media.embed(ref.kind, ref.path if ref.path is not None else ref.read(), ref.digest)


@dataclass
class LocalMedia:
    """A multimodal checkpoint's encoders in this process: batched across
    requests, writing embeddings into a shared-memory store."""

    batcher: EncoderBatcher
    media_embedder: MediaEmbedder
    embedder: LocalEmbedder

    async def aclose(self) -> None:
        await self.batcher.aclose()
        self.media_embedder.close()


def build_media(model_dir: Path, store: SharedEmbeddingStore, options: ServerOptions,
                metrics: ServerMetrics | None, device: str, dtype: str) -> LocalMedia | None:
    """The checkpoint's encoders over ``store``; None for a text-only one."""
    pipeline = media_pipeline(model_dir, store, options.max_upload_bytes, metrics, device, dtype)
    if pipeline is None:
        return None
    batcher, media_embedder = pipeline
    return LocalMedia(batcher, media_embedder, LocalEmbedder(media_embedder))


def media_pipeline(model_dir: Path, cache: SharedEmbeddingStore | EmbeddingCache, max_file_bytes: int,
                   metrics: ServerMetrics | None, device: str,
                   dtype: str) -> tuple[EncoderBatcher, MediaEmbedder] | None:
    """The checkpoint's encoders batched across requests, behind a ``MediaEmbedder``
    that decodes, preprocesses and caches in ``cache``: what serves media, in the
    API process (``serve``) and in a stack's encoder alike. None: the checkpoint
    has no encoders."""
    if not encoder_kinds(model_dir):
        return None  # before the imports below: a text-only server never needs torch for media
    from embedding_cache import MediaEmbedder
    from encoders import BatcherConfig, EncoderBatcher
    from encoders.multimodal_checkpoint import load_encoders
    from llm_core.device import compute_dtype

    encoders = load_encoders(model_dir, dtype=compute_dtype(dtype), device=device)
    on_batch = metrics.observe_encoder_batch if metrics is not None else None
    batcher = EncoderBatcher(encoders, BatcherConfig(), on_batch=on_batch)
    limits = MediaLimits(max_file_bytes=max_file_bytes)
    return batcher, MediaEmbedder(batcher, cache, media_config(model_dir, limits, device))
