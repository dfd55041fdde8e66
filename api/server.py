"""Starlette app: health, model list and OpenAI-compatible text completions.

The engine is not thread-safe, so generation runs on one dedicated worker
thread; the event loop only awaits it and streams tokens as they arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llm_core import LLM, SamplingParams

# Incomplete UTF-8 sequences decode to this; hold such text back while streaming.
_REPLACEMENT = "\ufffd"


class BadRequest(ValueError):
    """A request the client must fix (answered with HTTP 400)."""


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def parse_completion_request(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    prompts = _parse_prompts(body.get("prompt"))
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise BadRequest("only n=1 and best_of=1 are supported")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of them")
    stream_options = body.get("stream_options") or {}
    try:
        params = SamplingParams(
            max_tokens=_int_field(body, "max_tokens", 16),
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            top_k=_int_field(body, "top_k", -1),
            seed=None if body.get("seed") is None else _int_field(body, "seed", 0),
            stop_token_ids=tuple(_int_list(body.get("stop_token_ids") or [], "stop_token_ids")),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from exc
    return CompletionRequest(
        prompts=prompts,
        params=params,
        stop=tuple(stop),
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage", False)),
    )


def _int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}")
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"'{name}' must be a list of integers")
    return value


def _parse_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) for p in prompt):
            return [_int_list(p, "prompt") for p in prompt]
    raise BadRequest("'prompt' must be a string, a list of token ids, or a list of either")


def truncate_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Text up to the first stop string, and whether one was found."""
    cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


class CompletionService:
    def __init__(self, llm: LLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swallow-engine")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def validate(self, request: CompletionRequest) -> list[list[int]]:
        try:
            ids = [self.llm.encode_prompt(p) for p in request.prompts]
            for prompt_ids in ids:
                self.llm.check_length(len(prompt_ids), request.params.max_tokens)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        if request.stop and self.llm.tokenizer is None:
            raise BadRequest("'stop' strings need a model with a tokenizer; use stop_token_ids")
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.llm.tokenizer is None else self.llm.tokenizer.decode(token_ids)

    async def complete(self, request: CompletionRequest) -> dict[str, Any]:
        prompt_ids = self.validate(request)
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(self._executor, self.llm.generate, prompt_ids, request.params)
        choices = []
        for i, out in enumerate(outputs):
            text, stopped = truncate_at_stop(self.decode(out.token_ids), request.stop)
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "token_ids": out.token_ids,
                    "logprobs": None,
                    "finish_reason": "stop" if stopped else out.finish_reason,
                }
            )
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        return self._envelope(choices) | {"usage": _usage(prompt_ids, completion_tokens)}

    async def stream(self, request: CompletionRequest) -> AsyncIterator[str]:
        prompt_ids = self.validate(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, int, str | None] | None] = asyncio.Queue()

        def on_token(index: int, token: int, finish: str | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, token, finish))

        def run() -> None:
            try:
                self.llm.generate(prompt_ids, request.params, on_token=on_token)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        future = loop.run_in_executor(self._executor, run)
        tokens: list[list[int]] = [[] for _ in prompt_ids]
        sent_text = [""] * len(prompt_ids)
        sent_tokens = [0] * len(prompt_ids)
        done = [False] * len(prompt_ids)
        while (item := await queue.get()) is not None:
            index, token, finish = item
            if done[index]:
                continue
            tokens[index].append(token)
            text, stopped = truncate_at_stop(self.decode(tokens[index]), request.stop)
            if stopped:
                finish = "stop"
            elif finish is None and text.endswith(_REPLACEMENT):
                continue  # wait for the rest of a multi-byte character
            delta, sent_text[index] = text[len(sent_text[index]) :], text
            new_tokens, sent_tokens[index] = tokens[index][sent_tokens[index] :], len(tokens[index])
            done[index] = finish is not None
            choice = {"index": index, "text": delta, "token_ids": new_tokens,
                      "logprobs": None, "finish_reason": finish}
            yield _sse(self._envelope([choice]))
        await future
        if request.include_usage:
            usage = _usage(prompt_ids, sum(len(t) for t in tokens))
            yield _sse(self._envelope([]) | {"usage": usage})
        yield "data: [DONE]\n\n"

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
        }


def _usage(prompt_ids: list[list[int]], completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompt_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def create_app(llm: LLM, model_name: str) -> Starlette:
    service = CompletionService(llm, model_name)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> Response:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "swallow",
            "max_model_len": llm.config.max_position_embeddings,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        try:
            parsed = parse_completion_request(body)
            if parsed.stream:
                service.validate(parsed)  # fail with 400 before the stream starts
                return StreamingResponse(service.stream(parsed), media_type="text/event-stream")
            return JSONResponse(await service.complete(parsed))
        except BadRequest as exc:
            return error_response(400, str(exc))

    async def server_error(_: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        service.close()

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        exception_handlers={Exception: server_error},
        lifespan=lifespan,
    )
