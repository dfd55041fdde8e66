"""The server's routes by concern: the OpenAI-compatible endpoints, uploaded
files, and operations (health, metrics, statistics, the OpenAPI document).

Each is a route set built from the ``ServerContext`` every route shares; a
package mounted beside the API (the demo) passes its own sets to
``create_app`` the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from api.chat import BadRequest, parse_chat_request, parse_json_body
from api.chat_service import ChatService, media_cache_headers
from api.completion_service import CompletionService
from api.frontend import Frontend
from api.http import JSON_BODY_LIMIT, error_response, guarded, read_json, until_disconnected
from api.metrics import ServerMetrics
from api.openapi import OpenAPIPart
from api.options import ServerOptions
from api.uploads import FileStore, MultipartForm, StoredFile, parse_multipart

__all__ = ["CompletionRoutes", "FileRoutes", "OperationRoutes", "RouteSet", "RouteSetFactory", "ServerContext"]


@dataclass(frozen=True)
class ServerContext:
    """What a server's routes share: the model, its metrics and options, and the uploads."""

    model: Frontend
    metrics: ServerMetrics
    options: ServerOptions
    files: FileStore
    spool_root: Path


class RouteSet(Protocol):
    # Path prefixes that need the API key when the server has one.
    keyed_prefixes: tuple[str, ...]

    def routes(self) -> list[Route]: ...

    def openapi(self) -> OpenAPIPart | None:
        """What the set adds to the OpenAPI document (None: its paths are in the API's own)."""


RouteSetFactory = Callable[[ServerContext], RouteSet]


class CompletionRoutes:
    """`/v1/chat/completions`, `/v1/completions` and `/v1/models`."""

    keyed_prefixes = ("/v1/",)

    def __init__(self, context: ServerContext) -> None:
        self.context = context
        self.chat = ChatService(context.model, context.metrics)
        self.completions = CompletionService(self.chat)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.models),
            Route("/v1/completions", self.text_completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]

    def openapi(self) -> OpenAPIPart | None:
        return None

    async def chat_completions(self, request: Request) -> Response:
        form: MultipartForm | None = None
        options, chat = self.context.options, self.chat

        async def handle() -> Response:
            nonlocal form
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                form = await parse_multipart(request, self.context.spool_root / "requests", options.max_upload_bytes)
                if "request" not in form.fields:
                    raise BadRequest("a multipart chat request needs a 'request' part holding the JSON body")
                body = parse_json_body(form.fields["request"], "the 'request' part")
            else:
                body = await read_json(request, min(options.max_upload_bytes, JSON_BODY_LIMIT))
            parts = form.files if form is not None else {}

            def lookup(file_id: str) -> StoredFile | None:
                return parts.get(file_id) or self.context.files.get(file_id)

            parsed = parse_chat_request(body, lookup)
            built = await until_disconnected(request, chat.built_prompt(parsed))
            if form is not None:
                form.cleanup()  # embedded: the spooled media are no longer needed
            gens = await until_disconnected(request, chat.open_choices(parsed, built.token_ids, built.spans))
            headers = gens[0].headers | media_cache_headers(built) | {"x-request-id": parsed.request_id}
            if parsed.stream:
                return StreamingResponse(chat.stream(parsed, gens), media_type="text/event-stream", headers=headers)
            return JSONResponse(await until_disconnected(request, chat.complete(parsed, gens)), headers=headers)

        try:
            return await guarded(request, handle)
        finally:
            if form is not None:
                form.cleanup()

    async def text_completions(self, request: Request) -> Response:
        completions = self.completions

        async def handle() -> Response:
            body = await read_json(request, JSON_BODY_LIMIT)
            parsed = completions.parse(body)
            gens = await until_disconnected(request, completions.open(parsed))
            headers = {"x-request-id": parsed.request_id}
            if parsed.stream:
                return StreamingResponse(completions.stream(parsed, gens), media_type="text/event-stream",
                                         headers=headers)
            return JSONResponse(await until_disconnected(request, completions.complete(parsed, gens)), headers=headers)

        return await guarded(request, handle)

    async def models(self, _: Request) -> Response:
        model = self.context.model
        card = {
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": "swallow",
            "max_model_len": model.context_length,
            "input_modalities": ["text", *sorted(model.media_kinds)],
        }
        return JSONResponse({"object": "list", "data": [card]})


class FileRoutes:
    """`/v1/files`: uploads kept for later requests to name."""

    keyed_prefixes = ("/v1/",)

    def __init__(self, context: ServerContext) -> None:
        self.context = context
        self.files = context.files

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files", self.list, methods=["GET"]),
            Route("/v1/files/{file_id}", self.detail, methods=["GET", "DELETE"]),
        ]

    def openapi(self) -> OpenAPIPart | None:
        return None

    async def upload(self, request: Request) -> Response:
        async def handle() -> Response:
            stored = await self.files.save_upload(request)
            if stored.media_kind is not None and stored.media_kind not in self.context.model.media_kinds:
                self.files.delete(stored.id)
                raise BadRequest(f"this model does not take {stored.media_kind} input")
            return JSONResponse(stored.to_openai())

        return await guarded(request, handle)

    async def list(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [f.to_openai() for f in self.files.list()]})

    async def detail(self, request: Request) -> Response:
        file_id = request.path_params["file_id"]
        if request.method == "DELETE":
            if not self.files.delete(file_id):
                return error_response(404, f"no file {file_id!r}", "not_found")
            return JSONResponse({"id": file_id, "object": "file", "deleted": True})
        stored = self.files.get(file_id)
        if stored is None:
            return error_response(404, f"no file {file_id!r}", "not_found")
        return JSONResponse(stored.to_openai())


class OperationRoutes:
    """Health, liveness, statistics, the prefix cache's flush, metrics and the OpenAPI document."""

    keyed_prefixes = ("/flush_cache",)

    def __init__(self, context: ServerContext, document: dict) -> None:
        self.context = context
        self.document = document  # the whole server's, route sets mounted beside the API included

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health),
            Route("/livez", self.alive),
            Route("/openapi.json", self.openapi_spec),
            Route("/stats", self.engine_stats),
            Route("/flush_cache", self.flush_cache, methods=["POST"]),
            Route("/metrics", self.prometheus),
            Route("/metrics/summary", self.metrics_summary),
        ]

    def openapi(self) -> OpenAPIPart | None:
        return None

    async def alive(self, _: Request) -> Response:
        # The process answers (a liveness probe), whether or not it can serve now (/health).
        return JSONResponse({"status": "alive"})

    async def health(self, _: Request) -> Response:
        ready, detail = self.context.model.health()
        return JSONResponse({"status": "ok" if ready else "unavailable", **detail}, status_code=200 if ready else 503)

    async def openapi_spec(self, _: Request) -> Response:
        return JSONResponse(self.document)

    async def engine_stats(self, _: Request) -> Response:
        engine = self.context.model.engine
        return JSONResponse(await engine.current_stats() | {"pending_requests": engine.pending})

    async def flush_cache(self, _: Request) -> Response:
        return JSONResponse({"flushed": True, "stats": await self.context.model.engine.flush_cache()})

    async def prometheus(self, _: Request) -> Response:
        metrics = self.context.metrics
        metrics.set_engine_stats(await self.context.model.engine.current_stats())
        return Response(metrics.render(), media_type=metrics.content_type)

    async def metrics_summary(self, _: Request) -> Response:
        metrics = self.context.metrics
        metrics.set_engine_stats(await self.context.model.engine.current_stats())
        return JSONResponse(metrics.summary())
