"""The HTTP server: OpenAI-compatible chat and text completions, file uploads,
operations (health, metrics, statistics, the OpenAPI document), and whatever
route sets a package mounted beside the API passes in (the demo's page).

Request path for chat: parse (JSON, or multipart with a ``request`` part and file
parts spooled to disk) -> embed each media item (embedding cache, else
preprocess + batched encoders) -> chat template with placeholders expanded ->
the engine -> tokens streamed back. Every client mistake is a 4xx with a
reason; a client that goes away aborts its request and frees its KV.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from api.frontend import Frontend
from api.http import error_response
from api.metrics import ServerMetrics
from api.middleware import ApiKeyMiddleware, RequestMetricsMiddleware
from api.openapi import openapi_document
from api.routes import CompletionRoutes, FileRoutes, OperationRoutes, RouteSetFactory, ServerContext
from api.uploads import FileStore

__all__ = ["create_app"]


def create_app(model: Frontend, metrics: ServerMetrics | None = None,
               route_sets: Sequence[RouteSetFactory] = ()) -> Starlette:
    """The server for ``model``: the API's routes, then each of ``route_sets``
    built over the same context (their paths join the OpenAPI document)."""
    metrics = metrics or model.metrics or ServerMetrics()
    options = model.options
    spool_root = options.spool_dir or Path(tempfile.mkdtemp(prefix="swallow-uploads-"))
    spool_root.mkdir(parents=True, exist_ok=True)
    files = FileStore(spool_root / "files", options.max_upload_bytes)
    context = ServerContext(model, metrics, options, files, spool_root)
    mounted = [make(context) for make in route_sets]
    # Built once: it depends only on the model and the routes, which a server never changes.
    document = openapi_document(model.name, model.vocab_size, model.context_length, model.media_kinds,
                                [part for routes in mounted if (part := routes.openapi()) is not None])
    sets = [CompletionRoutes(context), FileRoutes(context), OperationRoutes(context, document), *mounted]

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await model.start()
        yield
        await model.aclose()
        files.close()
        if options.spool_dir is None:
            shutil.rmtree(spool_root, ignore_errors=True)

    app = Starlette(
        routes=[route for routes in sets for route in routes.routes()],
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    keyed = tuple(prefix for routes in sets for prefix in routes.keyed_prefixes)
    app.add_middleware(ApiKeyMiddleware, api_key=options.api_key, needs_key=lambda path: path.startswith(keyed))
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    return app


async def _http_error(request: Request, exc: HTTPException) -> Response:
    # Starlette's own answers (unknown path, wrong method) are plain text; clients parse JSON.
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind,
                          dict(exc.headers or {}))


async def _server_error(_: Request, exc: Exception) -> Response:
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
