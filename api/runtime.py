"""Everything one served model needs, in one process (the embedded
``Frontend``): the LLM on its engine thread, its chat template, and (for a
multimodal checkpoint) encoders, batcher and embedding cache."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api.chat import MediaRef
from api.engine_loop import AsyncEngine
from api.metrics import ServerMetrics
from api.options import ServerOptions
from embedding_cache import EmbeddingCache, SharedEmbeddingStore
from encoders import BatcherConfig, EncoderBatcher
from encoders.multimodal_checkpoint import encoder_kinds, load_encoders, placeholder_token_ids
from llm_core import LLM
from llm_core.model.chat import ChatTemplate
from llm_core.model.multimodal import MediaEmbedding
from llm_core.device import compute_dtype
from llm_core.model.tokenizer import Tokenizer
from media import VIDEO_PREPROCESS, MediaLimits, VisionPreprocessConfig

if TYPE_CHECKING:
    from embedding_cache import MediaEmbedder, MediaEmbedderConfig

__all__ = ["LocalEmbedder", "LocalMedia", "ServingModel", "build_media", "media_config",
           "media_kinds"]



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


def media_kinds(encoder_kinds: set[str] | frozenset[str], placeholder_ids: dict[str, int]) -> frozenset[str]:
    """Media kinds a model takes: those with an encoder and a placeholder token."""
    kinds = set()
    if "vision" in encoder_kinds:
        kinds |= {"image", "video"}
    if "audio" in encoder_kinds:
        kinds.add("audio")
    return frozenset(k for k in kinds if k in placeholder_ids)


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
    encoders = load_encoders(model_dir, dtype=compute_dtype(dtype), device=device)
    if not encoders:
        return None
    on_batch = metrics.observe_encoder_batch if metrics is not None else None
    batcher = EncoderBatcher(encoders, BatcherConfig(), on_batch=on_batch)
    limits = MediaLimits(max_file_bytes=max_file_bytes)
    from embedding_cache import MediaEmbedder  # media decoding: see media_config

    return batcher, MediaEmbedder(batcher, cache, media_config(model_dir, limits, device))


class ServingModel:
    """The model a server answers with, all in this process (the engine on a
    thread: ``swallow serve --engine-core thread``). Create inside the running
    event loop."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        name: str | None = None,
        options: ServerOptions = ServerOptions(),
        metrics: ServerMetrics | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        **engine_options: Any,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.name = name or self.model_dir.name
        self.options = options
        self.metrics = metrics
        self.llm = LLM(self.model_dir, device=device, dtype=dtype, **engine_options)
        self.chat_template = ChatTemplate.from_model_dir(self.model_dir)
        self.placeholder_ids = placeholder_token_ids(self.model_dir)
        on_step = metrics.set_engine_stats if metrics is not None else None
        self.engine = AsyncEngine(self.llm, max_pending=options.max_pending_requests, on_step=on_step)
        self.store: SharedEmbeddingStore | None = None
        self.media: LocalMedia | None = None
        if encoder_kinds(self.model_dir):
            name = options.embedding_cache_name or f"swallow-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self._own_store = options.embedding_cache_name is None
            self.store = SharedEmbeddingStore.open(name, options.embedding_cache_bytes)
            self.media = build_media(self.model_dir, self.store, options, metrics, device, dtype)

    @property
    def batcher(self) -> EncoderBatcher | None:
        return self.media.batcher if self.media is not None else None

    @property
    def embedder(self) -> LocalEmbedder | None:
        return self.media.embedder if self.media is not None else None

    @property
    def media_kinds(self) -> frozenset[str]:
        """Media kinds this model takes (those with an encoder and a placeholder token)."""
        return frozenset() if self.batcher is None else media_kinds(self.batcher.kinds, self.placeholder_ids)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.llm.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.llm.config.vocab_size

    @property
    def context_length(self) -> int:
        return self.llm.config.max_position_embeddings

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.llm.encode_prompt(prompt)

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.llm.check_length(num_prompt_tokens, max_tokens)

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {}

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        self.engine.close()
        self.llm.close()
        if self.media is not None:
            await self.media.aclose()
        if self.store is not None:
            self.store.close()
            if self._own_store:
                self.store.unlink()
