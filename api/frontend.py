"""What the HTTP server needs of a model, whether it runs in this process or
in a stack of processes.

``Frontend``: the model's name, tokenizer, chat template, placeholder ids,
context length and vocabulary (none of which need the weights), an
``Embedder`` for media and an ``EngineClient`` for generation.
``ServingModel`` (``runtime.py``) is the embedded one: encoders and one
engine in this process. ``StackFrontend`` (``stack/frontend.py``) sends media
to encoder processes and requests to worker processes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any, Protocol

from api.chat import MediaRef
from api.streams import Detokenizer, StreamEvent
from api.metrics import ServerMetrics
from api.options import ServerOptions
from llm_core import SamplingParams
from llm_core.model.chat import ChatTemplate
from llm_core.model.multimodal import MediaEmbedding, MultimodalSpan, SpanRef
from llm_core.model.tokenizer import Tokenizer

__all__ = ["Embedder", "EngineClient", "Frontend"]


class Embedder(Protocol):
    async def embed(self, ref: MediaRef) -> MediaEmbedding: ...


class EngineClient(Protocol):
    """Generation, wherever the engine runs. ``open`` admits a request or
    raises (``ValueError``: the client's fault, before any token), then
    yields its tokens; closing the stream aborts the request."""

    @property
    def pending(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    async def current_stats(self) -> dict[str, Any]:
        """``stats`` as of now: every request answered so far is counted."""

    async def open(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spans: Sequence[MultimodalSpan | SpanRef] = (),
        text: Detokenizer | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """``request_id``: the API's id of the request, which logs and messages carry (one is made up without)."""
        ...

    async def flush_cache(self) -> dict[str, Any]: ...


class Frontend(Protocol):
    model_dir: Path
    name: str
    options: ServerOptions
    metrics: ServerMetrics | None
    chat_template: ChatTemplate
    placeholder_ids: dict[str, int]
    engine: EngineClient

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def context_length(self) -> int: ...

    @property
    def media_kinds(self) -> frozenset[str]: ...

    @property
    def embedder(self) -> Embedder | None: ...

    def encode_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None: ...

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Whether it can serve now, and what /health shows of it."""

    async def start(self) -> None:
        """Inside the server's event loop, before the first request."""

    async def aclose(self) -> None: ...
