"""The HTTP server: OpenAI-compatible chat and text completions, file uploads,
metrics, and the video-QA demo page.

Request path for chat: parse (JSON, or multipart with a ``request`` part and file
parts spooled to disk) -> embed each media item (embedding cache, else
preprocess + batched encoders) -> chat template with placeholders expanded ->
the engine thread -> tokens streamed back. Every client mistake is a 4xx with a
reason; a client that goes away aborts its request and frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.chat import (
    BadRequest, ChatRequest, MediaRef, UnsupportedMedia, parse_bool, parse_chat_request, parse_choices,
    parse_include_usage, parse_int, parse_json_body, parse_sampling, parse_stop, require_unicode,
)
from api.chat_output import ChoiceDelta, ChoiceOutput, OutputOptions
from api.engine_loop import EngineOverloaded, EngineUnavailable, RequestFailed, StreamEvent
from api.frontend import Frontend, MediaEmbedding
from api.metrics import ServerMetrics
from api.openapi import openapi_document
from api.output_parsers import resolve_parser
from api.textstream import TextStream
from api.uploads import (
    FileStore, MultipartForm, StoredFile, UploadError, format_size, parse_multipart, refuse_declared_oversize,
)
from demo.samples import QUESTIONS_BY_KIND, SampleGallery
from demo.tools import ToolArgumentError, get_video_info
from encoders import EncoderQueueFull
from llm_core import MultimodalSpan, SamplingParams
from llm_core.chat import ChatTemplateError, MediaPart, build_chat_prompt
from llm_core.multimodal import SpanRef
from llm_core.sampling import MAX_TOP_LOGPROBS
from media import MediaError, has_audio_track

__all__ = ["create_app", "error_response"]

STATIC_DIR = Path(__file__).parent / "static"
_JSON_BODY_LIMIT = 64 << 20  # plain JSON bodies (base64 media included)


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


def _error_for(exc: Exception) -> JSONResponse | None:
    """The 4xx/5xx answer for a failure the client should hear about, or None."""
    if isinstance(exc, BadRequest | ChatTemplateError):
        return error_response(400, str(exc))
    if isinstance(exc, UnsupportedMedia):
        return error_response(415, str(exc), "unsupported_media_type")
    if isinstance(exc, UploadError):
        # Refused mid-upload: closing the connection stops the client sending the rest.
        return error_response(exc.status, exc.message, "upload_error", exc.headers)
    if isinstance(exc, MediaError):
        return error_response(exc.status, str(exc), "media_error")
    if isinstance(exc, EngineOverloaded):
        return error_response(429, str(exc), "rate_limit_exceeded")
    if isinstance(exc, EngineUnavailable):
        return error_response(503, str(exc), "server_overloaded")
    if isinstance(exc, RequestFailed):  # the server's fault, this request's alone: others go on
        return error_response(500, str(exc), "server_error")
    if isinstance(exc, EncoderQueueFull):
        return error_response(503, f"{exc}; retry shortly", "server_overloaded")
    if isinstance(exc, ValueError):  # engine-side validation (length, KV pool, spans)
        return error_response(400, str(exc))
    return None


# ---------------------------------------------------------------------------------------
# Middleware
# ---------------------------------------------------------------------------------------


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on /v1/* and on admin actions when the server has a key."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is not None and scope["type"] == "http" and _needs_key(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization")
            if given != self.expected:
                reason = "missing API key" if given is None else "invalid API key"
                await error_response(401, f"{reason}: send 'Authorization: Bearer <key>'", "authentication_error")(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


def _needs_key(path: str) -> bool:
    # The demo's tool reads uploaded files, as /v1/files does.
    return path.startswith(("/v1/", "/demo/tools/")) or path == "/flush_cache"


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            self.metrics.observe_request(_endpoint(scope["path"]), status)


def _endpoint(path: str) -> str:
    # File ids would give one label value per upload.
    return "/v1/files/{id}" if path.startswith("/v1/files/") else path


# ---------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------


class ChatService:
    def __init__(self, model: Frontend, metrics: ServerMetrics) -> None:
        self.model = model
        self.metrics = metrics
        model_type = _model_type(model.model_dir)
        options = model.options
        self.reasoning_parser = resolve_parser("reasoning", options.reasoning_parser, model_type)
        self.tool_parser = resolve_parser("tool_call", options.tool_call_parser, model_type)
        self._token_texts: dict[int, str] = {}

    async def embed(self, ref: MediaRef) -> MediaEmbedding:
        embedder = self.model.embedder
        if ref.kind not in self.model.media_kinds or embedder is None:
            raise BadRequest(f"this model does not take {ref.kind} input")
        emb = await embedder.embed(ref)
        self.metrics.count_embedding(ref.kind, emb.cached)
        return emb

    async def prompt(self, request: ChatRequest) -> tuple[list[int], list[MultimodalSpan | SpanRef]]:
        built = await self.built_prompt(request)
        return built.token_ids, built.spans

    async def built_prompt(self, request: ChatRequest) -> ChatPrompt:
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer.json, so it cannot chat; use /v1/completions with token ids")
        messages, refs = await self._with_sound_tracks(request.messages, request.media)
        embeddings = await asyncio.gather(*(self.embed(ref) for ref in refs))
        media = [MediaPart(ref.kind, emb.tensor, emb.key, emb.rows) for ref, emb in zip(refs, embeddings)]
        built = build_chat_prompt(self.model.chat_template, tokenizer, messages, media, self.model.placeholder_ids,
                                  request.template_variables)
        self.model.check_length(len(built.token_ids), request.params.max_tokens)
        return ChatPrompt(built.token_ids, built.spans, len(embeddings), sum(emb.cached for emb in embeddings))

    async def _with_sound_tracks(
        self, messages: list[dict[str, Any]], refs: list[MediaRef]
    ) -> tuple[list[dict[str, Any]], list[MediaRef]]:
        """A video with a sound track is heard too, when the model takes audio: its
        track becomes an audio part right after the video part."""
        if "audio" not in self.model.media_kinds or not any(r.kind == "video" for r in refs):
            return messages, refs
        loop = asyncio.get_running_loop()
        tracks = await asyncio.gather(*(
            loop.run_in_executor(None, has_audio_track, r.path if r.path is not None else r.read())
            if r.kind == "video" else _false() for r in refs
        ))
        if not any(tracks):
            return messages, refs
        pending = iter(zip(refs, tracks))
        out_refs: list[MediaRef] = []
        out_messages = []
        for message in messages:
            content = message["content"]
            if isinstance(content, str):
                out_messages.append(message)
                continue
            parts: list[dict[str, Any]] = []
            for part in content:
                parts.append(part)
                if part["type"] == "text":
                    continue
                ref, has_track = next(pending)
                out_refs.append(ref)
                if has_track:
                    parts.append({"type": "audio"})
                    out_refs.append(MediaRef("audio", data=ref.data, path=ref.path))
            out_messages.append({**message, "content": parts})
        return out_messages, out_refs

    async def open(
        self, prompt_ids: list[int], params: SamplingParams, spans: list[MultimodalSpan | SpanRef],
        stop: tuple[str, ...] = (),
    ) -> Generation:
        """Admit a request to the engine: whatever it refuses is raised here, before
        the response starts (so it can still be a 400). The engine thread
        detokenizes it and ends it at a stop string."""
        started = time.perf_counter()
        tokenizer = self.model.tokenizer
        text = None if tokenizer is None else TextStream(tokenizer.stream_decoder(), stop)
        stream = await self.model.engine.open(prompt_ids, params, spans, text)
        return Generation(stream, len(prompt_ids), started)

    async def open_choices(self, request: ChatRequest, prompt_ids: list[int],
                           spans: list[MultimodalSpan | SpanRef]) -> list[Generation]:
        """The request's ``n`` choices, admitted. The first is prefilled alone;
        the others start once its prompt is cached, so the prompt is computed
        once and each further choice only decodes. A seeded request's choice i
        draws with seed + i."""
        first = await self.open(prompt_ids, request.params, spans, request.stop)
        if request.n == 1:
            return [first]
        gens = [first]
        try:
            gens[0] = await first.peeked()  # its first token: the prefill is done and cached
            for i in range(1, request.n):
                seed = request.params.seed
                params = replace(request.params, seed=None if seed is None else (seed + i) % (1 << 64))
                gens.append(await self.open(prompt_ids, params, spans, request.stop))
        except BaseException:
            for gen in gens:
                await gen.stream.aclose()
            raise
        return gens

    async def events(self, gen: Generation) -> AsyncIterator[StreamEvent]:
        """The generation's events, with timing metrics."""
        count = 0
        last = gen.started
        try:
            async for event in gen.stream:
                now = time.perf_counter()
                if not count:
                    self.metrics.observe_ttft(now - gen.started)
                else:
                    self.metrics.observe_inter_token(now - last)
                last = now
                count += 1
                yield event
                if event.finish_reason is not None:
                    self.metrics.count_tokens(gen.num_prompt_tokens, count)
                    return
        finally:
            await gen.stream.aclose()  # a reader that stops early aborts the request at once, not at GC

    async def tokens(self, gen: Generation) -> AsyncIterator[tuple[str, str | None, list[int]]]:
        """(text delta, finish reason or None, the tokens so far)."""
        tokens: list[int] = []
        async for event in self.events(gen):
            tokens.append(event.token)
            yield event.text, event.finish_reason, tokens

    def output(self, request: ChatRequest) -> ChoiceOutput:
        options = OutputOptions(
            reasoning_parser=self.reasoning_parser,
            thinking_open=request.thinking,
            tool_parser=self.tool_parser if request.tools else None,
            tool_names=frozenset(tool["function"]["name"] for tool in request.tools),
            top_logprobs=request.top_logprobs,
        )
        return ChoiceOutput(options, self.token_text)

    def token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            tokenizer = self.model.tokenizer
            text = tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else str(token)
            self._token_texts[token] = text
        return text

    async def complete(self, request: ChatRequest, gens: list[Generation]) -> dict:
        async def one(gen: Generation) -> tuple[ChoiceOutput, str | None]:
            output, finish = self.output(request), None
            async for event in self.events(gen):
                output.feed(event)
                finish = event.finish_reason
            return output, output.finish_reason(finish)

        try:
            results = await _gather_or_cancel([one(gen) for gen in gens])
        finally:
            for gen in gens:
                await gen.stream.aclose()
        choices = [{"index": i, "message": output.message(), "finish_reason": finish, "logprobs": output.logprobs()}
                   for i, (output, finish) in enumerate(results)]
        outputs = [output for output, _ in results]
        return _chat_envelope(self.model.name, "chat.completion") | {
            "choices": choices, "usage": _chat_usage(gens[0].num_prompt_tokens, outputs),
        }

    async def stream(self, request: ChatRequest, gens: list[Generation]) -> AsyncIterator[str]:
        envelope = _chat_envelope(self.model.name, "chat.completion.chunk")
        for i in range(len(gens)):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                     "logprobs": None}
            yield _sse(envelope | {"choices": [first]})
        outputs = [self.output(request) for _ in gens]

        async def deltas(i: int, gen: Generation) -> AsyncIterator[tuple[int, ChoiceDelta, str | None]]:
            output = outputs[i]
            async for event in self.events(gen):
                delta = output.feed(event)
                if not delta.empty or event.finish_reason is not None:
                    yield i, delta, output.finish_reason(event.finish_reason)

        try:
            async with contextlib.aclosing(_interleaved([deltas(i, gen) for i, gen in enumerate(gens)])) as items:
                async for i, delta, finish in items:
                    logprobs = {"content": delta.logprobs} if request.top_logprobs is not None else None
                    choice = {"index": i, "delta": delta.as_delta(), "finish_reason": finish, "logprobs": logprobs}
                    yield _sse(envelope | {"choices": [choice]})
        except (RequestFailed, EngineUnavailable) as exc:
            yield _sse_error(exc)
        finally:
            for gen in gens:
                await gen.stream.aclose()
        if request.include_usage:
            yield _sse(envelope | {"choices": [], "usage": _chat_usage(gens[0].num_prompt_tokens, outputs)})
        yield "data: [DONE]\n\n"


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt, and how many of its media embeddings the embedding cache had."""

    token_ids: list[int]
    spans: list[MultimodalSpan | SpanRef]
    media_items: int
    media_cached: int

    @property
    def headers(self) -> dict[str, str]:
        return {"x-swallow-media-cache": f"hits={self.media_cached}; items={self.media_items}"}


@dataclass(frozen=True)
class Generation:
    """A request the engine has admitted: its token stream and when it was sent."""

    stream: AsyncGenerator[StreamEvent, None]
    num_prompt_tokens: int
    started: float
    worker_id: str | None = None  # which worker serves it, where a router chose one (the stack)
    decode_worker_id: str = ""  # disaggregated: the worker decoding it

    def _decode_worker(self) -> str:
        return self.decode_worker_id or getattr(self.stream, "decode_worker_id", "")

    @property
    def headers(self) -> dict[str, str]:
        worker = self.worker_id or getattr(self.stream, "worker_id", None)
        decode_worker = self._decode_worker()
        return ({"x-swallow-worker": worker} if worker else {}) | (
            {"x-swallow-decode-worker": decode_worker} if decode_worker else {})

    async def peeked(self) -> Generation:
        """This generation once its first event has arrived (the same events, from the first)."""
        first = await self.stream.__anext__()
        worker = self.worker_id or getattr(self.stream, "worker_id", None)
        return Generation(_prepend(first, self.stream), self.num_prompt_tokens, self.started, worker,
                          self._decode_worker())


async def _prepend(first: StreamEvent, rest: AsyncGenerator[StreamEvent, None]) -> AsyncGenerator[StreamEvent, None]:
    try:
        yield first
        if first.finish_reason is None:
            async for event in rest:
                yield event
    finally:
        await rest.aclose()


def _model_type(model_dir: Path) -> str | None:
    """config.json's ``model_type``: which output parsers the checkpoint calls for."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _chat_usage(prompt_tokens: int, outputs: list[ChoiceOutput]) -> dict[str, Any]:
    """OpenAI's usage: the prompt counted once, every choice's tokens, and the
    prompt tokens the prefix cache served (the first choice's; the others reuse
    the first's prefill)."""
    cached = outputs[0].cached_tokens if outputs else None
    return _usage(prompt_tokens, sum(o.num_tokens for o in outputs)) | {
        "prompt_tokens_details": {"cached_tokens": cached or 0},
    }


async def _false() -> bool:
    return False


def _sse_error(exc: RequestFailed | EngineUnavailable) -> str:
    """A failure after the 200 was sent can only travel inside the stream: the
    same error object the status line would have carried."""
    answer = _error_for(exc)
    assert answer is not None  # both kinds are mapped
    return f"data: {answer.body.decode()}\n\n"


def _chat_envelope(model: str, kind: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; cancel it (aborting its generation) if the client goes away."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientDisconnect()


async def _read_json(request: Request, limit: int) -> Any:
    too_large = f"request body exceeds the {format_size(limit)} limit"
    await refuse_declared_oversize(request, limit, too_large)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise UploadError(413, too_large, close_connection=True)
    return parse_json_body(bytes(body))


# ---------------------------------------------------------------------------------------
# Text completions
# ---------------------------------------------------------------------------------------


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [require_unicode(prompt, "'prompt'")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return [require_unicode(p, f"'prompt'[{i}]") for i, p in enumerate(prompt)]
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of either")


class CompletionService:
    """/v1/completions: one engine request per prompt, all through the engine thread."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat
        self.model = chat.model

    def parse(self, body: Any) -> CompletionRequest:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        n = parse_choices(body)
        if body.get("best_of") is not None and body.get("best_of") != n:
            raise BadRequest("'best_of' is not supported beyond 'n' (every choice is returned)")
        max_tokens = body.get("max_tokens")
        params = parse_sampling(body | {"max_tokens": 16 if max_tokens is None else max_tokens})
        if body.get("logprobs") is not None:
            logprobs = parse_int(body["logprobs"], "logprobs")
            if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise BadRequest(f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {logprobs!r}")
            params = replace(params, logprobs=logprobs)
        stop = parse_stop(body.get("stop"))
        if stop and self.model.tokenizer is None:
            raise BadRequest("'stop' strings need a model with a tokenizer; use stop_token_ids")
        prompts = [self.model.encode_prompt(p) for p in _prompts(body.get("prompt"))]
        for ids in prompts:
            self.model.check_length(len(ids), params.max_tokens)
        return CompletionRequest(prompts, params, stop, parse_bool(body, "stream"),
                                 parse_include_usage(body, default=False), n)

    async def open(self, request: CompletionRequest) -> list[Generation]:
        """Admit every choice of every prompt (prompt i's choice j at i * n + j),
        or none: one refused closes those already admitted. A prompt's further
        choices start once its first has been prefilled, and reuse that prefill."""
        opened: list[Generation] = []
        params = request.params
        try:
            for ids in request.prompts:
                first = await self.chat.open(ids, params, [], request.stop)
                opened.append(first)
                if request.n == 1:
                    continue
                opened[-1] = await first.peeked()
                for j in range(1, request.n):
                    seed = None if params.seed is None else (params.seed + j) % (1 << 64)
                    opened.append(await self.chat.open(ids, replace(params, seed=seed), [], request.stop))
        except BaseException:
            for gen in opened:
                await gen.stream.aclose()
            raise
        return opened

    async def _one(self, gen: Generation) -> dict[str, Any]:
        text, finish, tokens = "", None, []
        logprobs = _LegacyLogprobs(self.chat.token_text)
        async for event in self.chat.events(gen):
            logprobs.add(event, len(text))
            text += event.text
            finish = event.finish_reason
            tokens.append(event.token)
        return {"text": text, "finish_reason": finish, "token_ids": tokens, "logprobs": logprobs.as_dict()}

    async def complete(self, gens: list[Generation], n: int = 1) -> dict:
        try:
            results = await _gather_or_cancel([self._one(gen) for gen in gens])
        finally:
            for gen in gens:  # one failed: the others' work is this client's, and it gets an error
                await gen.stream.aclose()
        choices = [
            {"index": i, "text": r["text"], "token_ids": r["token_ids"], "logprobs": r["logprobs"],
             "finish_reason": r["finish_reason"]}
            for i, r in enumerate(results)
        ]
        total = sum(len(r["token_ids"]) for r in results)
        return _completion_envelope(self.chat.model.name) | {
            "choices": choices,
            "usage": _usage(_prompt_tokens(gens, n), total),
        }

    async def stream(self, gens: list[Generation], include_usage: bool, n: int = 1) -> AsyncIterator[str]:
        async def pieces(i: int, gen: Generation) -> AsyncIterator[tuple[int, str, str | None, list[int],
                                                                          dict[str, Any] | None]]:
            tokens: list[int] = []
            logprobs = _LegacyLogprobs(self.chat.token_text)
            offset = 0
            # Every token goes out as it comes, its text when there is some: a
            # client counting tokens (or a model without a tokenizer) never waits
            # for a character to complete.
            async for event in self.chat.events(gen):
                tokens.append(event.token)
                logprobs.add(event, offset)
                offset += len(event.text)
                yield i, event.text, event.finish_reason, tokens, logprobs.as_dict()
                tokens = []
                logprobs = _LegacyLogprobs(self.chat.token_text)

        counts = [0] * len(gens)
        envelope = _completion_envelope(self.chat.model.name)  # one id for the whole stream
        sources = [pieces(i, gen) for i, gen in enumerate(gens)]
        try:
            # One choice needs no interleaving (and none of its per-token hops).
            async with contextlib.aclosing(sources[0] if len(sources) == 1 else _interleaved(sources)) as items:
                async for i, delta, finish, new_tokens, logprobs in items:
                    counts[i] += len(new_tokens)
                    choice = {"index": i, "text": delta, "token_ids": new_tokens, "logprobs": logprobs,
                              "finish_reason": finish}
                    yield _sse(envelope | {"choices": [choice]})
        except (RequestFailed, EngineUnavailable) as exc:
            yield _sse_error(exc)
        finally:
            for gen in gens:
                await gen.stream.aclose()
        if include_usage:
            usage = _usage(_prompt_tokens(gens, n), sum(counts))
            yield _sse(envelope | {"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"


async def _interleaved(sources: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """Every source's items as they come. When one source fails, the others
    are cancelled and the failure is raised here; closing this generator
    cancels them all (nobody reads their streams while they close)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(source: AsyncIterator[Any]) -> None:
        async for item in source:
            await queue.put(item)

    async def run_all() -> None:
        try:
            await _gather_or_cancel([pump(source) for source in sources])
        finally:
            await queue.put(done)

    runner = asyncio.ensure_future(run_all())
    try:
        while (item := await queue.get()) is not done:
            yield item
        await runner
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def _gather_or_cancel(aws: list[Awaitable[Any]]) -> list[Any]:
    """Every result; when one fails the others are cancelled, and awaited, before
    the failure is raised (plain gather leaves them running)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[list[int]]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1


def _prompt_tokens(gens: list[Generation], n: int) -> int:
    """Each prompt counted once, however many choices it has."""
    return sum(gen.num_prompt_tokens for gen in gens[::n])


class _LegacyLogprobs:
    """/v1/completions' ``logprobs``: parallel lists of tokens, their logprobs,
    their top alternatives ({token: logprob}) and where each starts in the text."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self._token_text = token_text
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, event: StreamEvent, offset: int) -> None:
        if event.logprob is None:
            return
        self.tokens.append(self._token_text(event.token))
        self.token_logprobs.append(event.logprob)
        self.top_logprobs.append({self._token_text(t): lp for t, lp in event.top_logprobs})
        self.text_offset.append(offset)

    def as_dict(self) -> dict[str, Any] | None:
        if not self.tokens:
            return None
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def _completion_envelope(model: str) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model}


# ---------------------------------------------------------------------------------------
# App
# ---------------------------------------------------------------------------------------


def create_app(model: Frontend, metrics: ServerMetrics | None = None) -> Starlette:
    metrics = metrics or model.metrics or ServerMetrics()
    options = model.options
    spool_root = options.spool_dir or Path(tempfile.mkdtemp(prefix="swallow-uploads-"))
    spool_root.mkdir(parents=True, exist_ok=True)
    files = FileStore(spool_root / "files", options.max_upload_bytes)
    chat = ChatService(model, metrics)
    completions = CompletionService(chat)

    async def guarded(request: Request, handler: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await handler()
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - mapped to a status below, else re-raised
            answer = _error_for(exc)
            if answer is None:
                raise
            return answer

    async def chat_completions(request: Request) -> Response:
        form: MultipartForm | None = None

        async def handle() -> Response:
            nonlocal form
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                form = await parse_multipart(request, spool_root / "requests", options.max_upload_bytes)
                if "request" not in form.fields:
                    raise BadRequest("a multipart chat request needs a 'request' part holding the JSON body")
                body = parse_json_body(form.fields["request"], "the 'request' part")
            else:
                body = await _read_json(request, min(options.max_upload_bytes, _JSON_BODY_LIMIT))
            parts = form.files if form is not None else {}

            def lookup(file_id: str) -> StoredFile | None:
                return parts.get(file_id) or files.get(file_id)

            parsed = parse_chat_request(body, lookup)
            built = await _until_disconnected(request, chat.built_prompt(parsed))
            if form is not None:
                form.cleanup()  # embedded: the spooled media are no longer needed
            gens = await _until_disconnected(request, chat.open_choices(parsed, built.token_ids, built.spans))
            headers = gens[0].headers | built.headers
            if parsed.stream:
                return StreamingResponse(chat.stream(parsed, gens), media_type="text/event-stream", headers=headers)
            return JSONResponse(await _until_disconnected(request, chat.complete(parsed, gens)), headers=headers)

        try:
            return await guarded(request, handle)
        finally:
            if form is not None:
                form.cleanup()

    async def text_completions(request: Request) -> Response:
        async def handle() -> Response:
            body = await _read_json(request, _JSON_BODY_LIMIT)
            parsed = completions.parse(body)
            gens = await _until_disconnected(request, completions.open(parsed))
            if parsed.stream:
                return StreamingResponse(completions.stream(gens, parsed.include_usage, parsed.n),
                                         media_type="text/event-stream")
            return JSONResponse(await _until_disconnected(request, completions.complete(gens, parsed.n)))

        return await guarded(request, handle)

    async def upload_file(request: Request) -> Response:
        async def handle() -> Response:
            stored = await files.save_upload(request)
            if stored.media_kind is not None and stored.media_kind not in model.media_kinds:
                files.delete(stored.id)
                raise BadRequest(f"this model does not take {stored.media_kind} input")
            return JSONResponse(stored.to_openai())

        return await guarded(request, handle)

    async def list_files(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [f.to_openai() for f in files.list()]})

    async def file_detail(request: Request) -> Response:
        file_id = request.path_params["file_id"]
        if request.method == "DELETE":
            deleted = files.delete(file_id)
            if not deleted:
                return error_response(404, f"no file {file_id!r}", "not_found")
            return JSONResponse({"id": file_id, "object": "file", "deleted": True})
        stored = files.get(file_id)
        if stored is None:
            return error_response(404, f"no file {file_id!r}", "not_found")
        return JSONResponse(stored.to_openai())

    async def alive(_: Request) -> Response:
        # The process answers (a liveness probe), whether or not it can serve now (/health).
        return JSONResponse({"status": "alive"})

    async def health(_: Request) -> Response:
        ready, detail = model.health()
        return JSONResponse({"status": "ok" if ready else "unavailable", **detail}, status_code=200 if ready else 503)

    # Built once: it depends only on the model, which a server never changes.
    spec = openapi_document(model.name, model.vocab_size, model.context_length,
                            model.media_kinds)

    async def openapi_spec(_: Request) -> Response:
        return JSONResponse(spec)

    async def engine_stats(_: Request) -> Response:
        return JSONResponse(await model.engine.current_stats() | {"pending_requests": model.engine.pending})

    async def flush_cache(_: Request) -> Response:
        return JSONResponse({"flushed": True, "stats": await model.engine.flush_cache()})

    async def models(_: Request) -> Response:
        card = {
            "id": model.name,
            "object": "model",
            "created": 0,
            "owned_by": "swallow",
            "max_model_len": model.context_length,
            "input_modalities": ["text", *sorted(model.media_kinds)],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def prometheus(_: Request) -> Response:
        metrics.set_engine_stats(await model.engine.current_stats())
        return Response(metrics.render(), media_type=metrics.content_type)

    async def metrics_summary(_: Request) -> Response:
        metrics.set_engine_stats(await model.engine.current_stats())
        return JSONResponse(metrics.summary())

    # The page's sample clips, pictures and sounds: rendered on first request, off the event loop.
    gallery = SampleGallery(spool_root / "samples")

    async def demo_samples(_: Request) -> Response:
        items = await asyncio.get_running_loop().run_in_executor(None, gallery.items)
        return JSONResponse({"samples": [item.to_json() for item in items], "questions_by_kind": QUESTIONS_BY_KIND})

    async def demo_tool(request: Request) -> Response:
        """Runs the demo's tool on an uploaded file, so the page can finish a tool round trip."""
        async def handle() -> Response:
            body = await _read_json(request, _JSON_BODY_LIMIT)
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object with 'file_id' and 'arguments'")
            if request.path_params["name"] != "get_video_info":
                return error_response(404, f"no demo tool {request.path_params['name']!r}", "not_found")
            stored = files.get(body.get("file_id")) if isinstance(body.get("file_id"), str) else None
            if stored is None:
                raise BadRequest("'file_id' must name an uploaded file (POST /v1/files)")
            try:
                content = await asyncio.get_running_loop().run_in_executor(
                    None, get_video_info, stored.path, body.get("arguments"))
            except ToolArgumentError as exc:
                raise BadRequest(str(exc)) from None
            return JSONResponse({"content": content})

        return await guarded(request, handle)

    async def demo_sample_file(request: Request) -> Response:
        item = await asyncio.get_running_loop().run_in_executor(None, gallery.find, request.path_params["name"])
        if item is None:
            return error_response(404, f"no sample {request.path_params['name']!r}", "not_found")
        return FileResponse(item.path, media_type=item.media_type, filename=item.path.name)

    async def demo_page(_: Request) -> Response:
        page = STATIC_DIR / "index.html"
        if not page.exists():
            return error_response(404, "the demo page is not installed", "not_found")
        return FileResponse(page, media_type="text/html")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Starlette's own answers (unknown path, wrong method) are plain text; clients parse JSON.
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind,
                              dict(exc.headers or {}))

    async def server_error(_: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await model.start()
        yield
        await model.aclose()
        files.close()
        if options.spool_dir is None:
            shutil.rmtree(spool_root, ignore_errors=True)

    app = Starlette(
        routes=[
            Route("/", demo_page),
            Route("/health", health),
            Route("/livez", alive),
            Route("/openapi.json", openapi_spec),
            Route("/stats", engine_stats),
            Route("/flush_cache", flush_cache, methods=["POST"]),
            Route("/metrics", prometheus),
            Route("/metrics/summary", metrics_summary),
            Route("/demo/samples", demo_samples),
            Route("/demo/samples/{name}", demo_sample_file),
            Route("/demo/tools/{name}", demo_tool, methods=["POST"]),
            Route("/v1/models", models),
            Route("/v1/completions", text_completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/files", upload_file, methods=["POST"]),
            Route("/v1/files", list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", file_detail, methods=["GET", "DELETE"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    return app
