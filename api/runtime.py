"""Everything one served model needs, in one process (the embedded
``Frontend``): the LLM on its engine thread, its chat template, and (for a
multimodal checkpoint) encoders, batcher and embedding cache."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from api.engine_loop import AsyncEngine
from api.media_pipeline import LocalEmbedder, LocalMedia, build_media
from api.metrics import ServerMetrics
from api.options import ServerOptions
from embedding_cache import SharedEmbeddingStore
from encoders import EncoderBatcher
from encoders.media_kinds import encoder_kinds, media_kinds, placeholder_token_ids
from llm_core import LLM
from llm_core.model.chat import ChatTemplate
from llm_core.model.tokenizer import Tokenizer

__all__ = ["ServingModel"]



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
