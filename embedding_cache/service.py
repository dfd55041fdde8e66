"""Media in, embeddings out: the cache in front of preprocessing and the encoders.

For each media item the lookup goes, cheapest first:

1. **Upload key** -- hash of the file's bytes + preprocessing parameters + encoder
   identity. A hit returns the embedding without decoding anything.
2. **Content key** -- hash of the *decoded* content (pixels of the sampled frames,
   PCM samples) + parameters + encoder. The same picture re-encoded as another
   file still hits here; the upload key is then recorded as an alias.
3. Miss: preprocess, encode through the ``EncoderBatcher`` (fused with other
   requests' items), store under the content key and alias the upload key.

Aliases are 32-byte values holding the content key, so a file and its re-encodings
share one stored embedding.
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from embedding_cache.cluster import EmbeddingCache
from embedding_cache.keys import KEY_BYTES, file_digest, media_key
from embedding_cache.store import SharedEmbeddingStore
from encoders.audio import AudioInput
from encoders.batcher import EncoderBatcher
from encoders.vision import VisionInput
from llm_core.model.multimodal import MediaEmbedding
from media import (
    DEFAULT_LIMITS,
    VIDEO_PREPROCESS,
    MediaLimits,
    VisionPreprocessConfig,
    audio_features,
    load_audio,
    load_image,
    load_video,
    preprocess_images,
    preprocess_video,
)

__all__ = ["MediaEmbedder", "MediaEmbedderConfig"]

_T = TypeVar("_T")
_HOP_LENGTH = 160  # Whisper mel hop: one feature frame per 10 ms at 16 kHz


@dataclass(frozen=True)
class MediaEmbedderConfig:
    image: VisionPreprocessConfig = VisionPreprocessConfig()
    video: VisionPreprocessConfig = VIDEO_PREPROCESS
    video_fps: float = 2.0
    video_max_frames: int = 64
    audio_sample_rate: int = 16000
    limits: MediaLimits = DEFAULT_LIMITS
    # Where images and clips are resized, normalised and patchified: the
    # encoders' device. On CUDA that is torchvision on the GPU (decoding stays
    # on the CPU: the content key hashes the decoded pixels).
    preprocess_device: str = "cpu"

    def __post_init__(self) -> None:
        torch.device(self.preprocess_device)  # a name torch does not know fails here, not at the first image

    def preprocess_params(self) -> dict[str, str]:
        """What keys must add for it: GPU preprocessing is not bit-identical to
        the CPU's, so its embeddings never answer for the CPU's (nor the reverse)."""
        kind = torch.device(self.preprocess_device).type
        return {} if kind == "cpu" else {"preprocess_on": kind}


@dataclass
class EmbedderStats:
    upload_hits: int = 0
    content_hits: int = 0
    misses: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


class MediaEmbedder:
    """Embeds media items of many concurrent requests, through the shared cache."""

    def __init__(
        self,
        batcher: EncoderBatcher,
        cache: EmbeddingCache | SharedEmbeddingStore | None = None,
        config: MediaEmbedderConfig = MediaEmbedderConfig(),
        executor: Executor | None = None,
    ) -> None:
        self.batcher = batcher
        self.cache = cache if isinstance(cache, EmbeddingCache) or cache is None else EmbeddingCache(cache)
        self.config = config
        self._own_executor = executor is None
        # Decoding and preprocessing release the GIL (FFmpeg, libjpeg, torch ops).
        self._executor = executor or ThreadPoolExecutor(
            max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="media"
        )
        self.stats = EmbedderStats()

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False)

    # -- public -----------------------------------------------------------------

    async def embed(self, kind: str, source: str | os.PathLike[str] | bytes,
                    digest: bytes | None = None) -> MediaEmbedding:
        """One media item of ``kind`` ("image", "video" or "audio"), from a file
        path or its bytes: the one place a kind picks its decoding, keys and
        encoder (images are read whole). ``digest`` is the source's
        ``file_digest`` when the caller has it already (a clip seen and heard)."""
        if kind == "image":
            return await self.embed_image(source if isinstance(source, bytes) else Path(source).read_bytes(), digest)
        if kind == "video":
            return await self.embed_video(source, digest)
        if kind == "audio":
            return await self.embed_audio(source, digest)
        raise ValueError(f"unknown media kind {kind!r}: image, video or audio")

    async def embed_image(self, data: bytes, digest: bytes | None = None) -> MediaEmbedding:
        params = {"image": self.config.image, **self.config.preprocess_params()}
        encoder = self._identity("vision")
        upload = await self._upload_key("image", data, digest, params, encoder)
        if (hit := await self._lookup_upload(upload)) is not None:
            return self._hit("image", hit, upload=True)
        image = await self._run(load_image, data, limits=self.config.limits)
        content = await self._run(media_key, "image", image, params, encoder)
        if (emb := await self._lookup(content)) is not None:
            await self._alias(upload, content)
            return self._hit("image", (content, emb), upload=False)
        batch = await self._run(preprocess_images, [image], self.config.image, self.config.preprocess_device)
        item = VisionInput(batch.pixel_values, tuple(int(x) for x in batch.grid_thw[0].tolist()))
        return await self._encode_and_store("image", "vision", item, content, upload)

    async def embed_video(self, source: str | os.PathLike[str] | bytes,
                          digest: bytes | None = None) -> MediaEmbedding:
        """``source`` is a file path (uploads are spooled to disk) or the file's bytes."""
        if isinstance(source, bytes):
            digest = digest if digest is not None else await self._run(file_digest, source)
            return await self._with_temp_file(source, lambda path: self.embed_video(path, digest))
        params = {"video": self.config.video, "fps": self.config.video_fps, "max_frames": self.config.video_max_frames,
                  **self.config.preprocess_params()}
        encoder = self._identity("vision")
        upload = await self._upload_key("video", source, digest, params, encoder)
        if (hit := await self._lookup_upload(upload)) is not None:
            return self._hit("video", hit, upload=True)
        frames = await self._run(
            load_video,
            source,
            fps=self.config.video_fps,
            max_frames=self.config.video_max_frames,
            limits=self.config.limits,
        )
        content = await self._run(media_key, "video", frames.frames, params, encoder)
        if (emb := await self._lookup(content)) is not None:
            await self._alias(upload, content)
            return self._hit("video", (content, emb), upload=False)
        batch = await self._run(preprocess_video, frames.frames, self.config.video, self.config.preprocess_device)
        item = VisionInput(batch.pixel_values, tuple(int(x) for x in batch.grid_thw[0].tolist()))
        return await self._encode_and_store("video", "vision", item, content, upload)

    async def embed_audio(self, source: str | os.PathLike[str] | bytes,
                          digest: bytes | None = None) -> MediaEmbedding:
        audio_encoder: Any = self.batcher.encoder("audio")
        n_mels = int(audio_encoder.config.num_mel_bins)
        chunk_seconds = audio_encoder.config.chunk_frames * _HOP_LENGTH / self.config.audio_sample_rate
        params = {"sample_rate": self.config.audio_sample_rate, "n_mels": n_mels, "chunk_seconds": chunk_seconds}
        encoder = self._identity("audio")
        upload = await self._upload_key("audio", source, digest, params, encoder)
        if (hit := await self._lookup_upload(upload)) is not None:
            return self._hit("audio", hit, upload=True)
        wave = await self._run(
            load_audio, source, sample_rate=self.config.audio_sample_rate, limits=self.config.limits
        )
        content = await self._run(media_key, "audio", wave, params, encoder)
        if (emb := await self._lookup(content)) is not None:
            await self._alias(upload, content)
            return self._hit("audio", (content, emb), upload=False)
        features = await self._run(audio_features, wave, n_mels=n_mels, chunk_seconds=chunk_seconds)
        num_frames = min(math.ceil(wave.numel() / _HOP_LENGTH), features.shape[0] * features.shape[-1])
        item = AudioInput(features, num_frames)
        return await self._encode_and_store("audio", "audio", item, content, upload)

    # -- internals --------------------------------------------------------------

    async def _upload_key(self, kind: str, source: str | os.PathLike[str] | bytes, digest: bytes | None,
                          params: dict[str, Any], encoder: str) -> bytes:
        """The key of these file bytes under these parameters and encoder."""
        if digest is None:
            digest = await self._run(file_digest, source)
        elif len(digest) != KEY_BYTES:
            raise ValueError(f"a media digest is {KEY_BYTES} bytes, not {len(digest)}")
        return media_key(f"{kind}-upload", digest, params, encoder)

    def _identity(self, kind: str) -> str:
        return str(self.batcher.encoder(kind).identity)

    async def _run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def _with_temp_file(self, data: bytes, fn: Callable[[str], Any]) -> Any:
        fd, path = tempfile.mkstemp(prefix="swallow-media-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return await fn(path)
        finally:
            os.unlink(path)

    async def _lookup(self, key: bytes) -> torch.Tensor | None:
        return None if self.cache is None else await self.cache.get(key)

    async def _lookup_upload(self, upload: bytes) -> tuple[bytes, torch.Tensor] | None:
        alias = await self._lookup(upload)
        if alias is None or alias.dtype != torch.uint8 or alias.numel() != KEY_BYTES:
            return None
        content = bytes(alias.tolist())
        emb = await self._lookup(content)
        return None if emb is None else (content, emb)

    async def _alias(self, upload: bytes, content: bytes) -> None:
        if self.cache is not None:
            await self.cache.put(upload, torch.frombuffer(bytearray(content), dtype=torch.uint8))

    def _hit(self, kind: str, found: tuple[bytes, torch.Tensor], *, upload: bool) -> MediaEmbedding:
        if upload:
            self.stats.upload_hits += 1
        else:
            self.stats.content_hits += 1
        self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1
        content, tensor = found
        return MediaEmbedding(kind, content, int(tensor.shape[0]), tensor, cached=True)

    async def _encode_and_store(
        self, kind: str, encoder_kind: str, item: Any, content: bytes, upload: bytes
    ) -> MediaEmbedding:
        tensor = await self.batcher.encode(encoder_kind, item)
        self.stats.misses += 1
        self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1
        if self.cache is not None:
            await self.cache.put(content, tensor.detach().cpu())
            await self._alias(upload, content)
        return MediaEmbedding(kind, content, int(tensor.shape[0]), tensor, cached=False)

