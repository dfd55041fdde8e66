"""`serve`'s frontend over its engine-core process (api/engine_core.py): the
stack's API with one worker, and the media encoders in this process, writing
the embedding store the engine core reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from api.engine_core import EngineCoreProcess
from api.frontend import Embedder
from api.metrics import ServerMetrics
from api.options import ServerOptions
from api.media_pipeline import build_media
from api.stack.frontend import StackFrontend
from embedding_cache import SharedEmbeddingStore
from encoders.media_kinds import media_kinds

__all__ = ["EngineCoreFrontend"]


class EngineCoreFrontend(StackFrontend):
    """`serve`'s frontend over its engine-core process: the stack's API with
    one worker, and the media encoders in this process, writing the store the
    engine core reads."""

    def __init__(self, model_dir: str | Path, *, engine_core: EngineCoreProcess, name: str | None = None,
                 options: ServerOptions = ServerOptions(), metrics: ServerMetrics | None = None,
                 device: str = "cpu", dtype: str = "float32") -> None:
        # One worker: nothing to route on, so no prefix hashing per request.
        super().__init__(model_dir, workers=engine_core.address, name=name, options=options, metrics=metrics,
                         route_policy="round-robin")
        self.engine_core = engine_core
        self.store = SharedEmbeddingStore.attach(engine_core.plan.store_name)
        self.media = build_media(self.model_dir, self.store, options, metrics, device, dtype)
        if self.media is not None:
            self._kinds = media_kinds(self.media.batcher.kinds, self.placeholder_ids)

    @property
    def embedder(self) -> Embedder | None:
        return self.media.embedder if self.media is not None else None

    def health(self) -> tuple[bool, dict[str, Any]]:
        ready, detail = super().health()
        return ready, {"role": "serve", "engine_core": detail["workers"]}

    async def aclose(self) -> None:
        await super().aclose()
        if self.media is not None:
            await self.media.aclose()
        self.store.close()
