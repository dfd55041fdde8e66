"""Chat completions: a parsed request -> its prompt (chat template, media
embedded) -> one generation per choice -> streamed chunks or one answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from api.chat import BadRequest, ChatRequest, MediaRef, choice_request_id
from api.chat_output import ChoiceDelta, ChoiceOutput, OutputOptions
from api.streams import EngineUnavailable, RequestFailed, StreamEvent
from api.frontend import Frontend
from api.http import error_for
from api.metrics import ServerMetrics
from api.output_parsers import resolve_parser
from api.textstream import TextStream
from llm_core import MultimodalSpan, SamplingParams
from llm_core.model.chat import ChatPrompt, build_chat_prompt
from llm_core.model.multimodal import MediaEmbedding, SpanRef
from embedding_cache.keys import file_digest
from media import has_audio_track

__all__ = ["ChatService", "Generation", "gather_or_cancel", "interleaved", "media_cache_headers", "sse", "sse_error",
           "usage_of", "with_sound_tracks"]


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

    async def embedded_media(
        self, messages: list[dict[str, Any]], refs: list[MediaRef]
    ) -> tuple[list[dict[str, Any]], list[MediaEmbedding]]:
        """The messages (a clip's sound track added as a part of its own, when
        the model hears) and their media items, embedded."""
        if "audio" in self.model.media_kinds:
            messages, refs = await with_sound_tracks(messages, refs)
        return messages, list(await asyncio.gather(*(self.embed(ref) for ref in refs)))

    async def built_prompt(self, request: ChatRequest) -> ChatPrompt:
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer.json, so it cannot chat; use /v1/completions with token ids")
        messages, media = await self.embedded_media(request.messages, request.media)
        built = build_chat_prompt(self.model.chat_template, tokenizer, messages, media, self.model.placeholder_ids,
                                  request.template_variables)
        self.model.check_length(len(built.token_ids), request.params.max_tokens)
        return built

    async def open(
        self, prompt_ids: list[int], params: SamplingParams, spans: list[MultimodalSpan | SpanRef],
        stop: tuple[str, ...] = (), request_id: str | None = None,
    ) -> Generation:
        """Admit a request to the engine: whatever it refuses is raised here, before
        the response starts (so it can still be a 400). The engine thread
        detokenizes it and ends it at a stop string."""
        started = time.perf_counter()
        tokenizer = self.model.tokenizer
        text = None if tokenizer is None else TextStream(tokenizer.stream_decoder(), stop)
        stream = await self.model.engine.open(prompt_ids, params, spans, text, request_id=request_id)
        return Generation(stream, len(prompt_ids), started)

    async def open_choices(self, request: ChatRequest, prompt_ids: list[int],
                           spans: list[MultimodalSpan | SpanRef]) -> list[Generation]:
        """The request's ``n`` choices, admitted. The first is prefilled alone;
        the others start once its prompt is cached, so the prompt is computed
        once and each further choice only decodes. A seeded request's choice i
        draws with seed + i."""
        first = await self.open(prompt_ids, request.params, spans, request.stop, request.request_id)
        if request.n == 1:
            return [first]
        gens = [first]
        try:
            gens[0] = await first.peeked()  # its first token: the prefill is done and cached
            for i in range(1, request.n):
                seed = request.params.seed
                params = replace(request.params, seed=None if seed is None else (seed + i) % (1 << 64))
                gens.append(await self.open(prompt_ids, params, spans, request.stop,
                                            choice_request_id(request.request_id, i)))
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
            results = await gather_or_cancel([one(gen) for gen in gens])
        finally:
            for gen in gens:
                await gen.stream.aclose()
        choices = [{"index": i, "message": output.message(), "finish_reason": finish, "logprobs": output.logprobs()}
                   for i, (output, finish) in enumerate(results)]
        outputs = [output for output, _ in results]
        return _chat_envelope(request.request_id, self.model.name, "chat.completion") | {
            "choices": choices, "usage": _chat_usage(gens[0].num_prompt_tokens, outputs),
        }

    async def stream(self, request: ChatRequest, gens: list[Generation]) -> AsyncIterator[str]:
        envelope = _chat_envelope(request.request_id, self.model.name, "chat.completion.chunk")
        for i in range(len(gens)):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                     "logprobs": None}
            yield sse(envelope | {"choices": [first]})
        outputs = [self.output(request) for _ in gens]

        async def deltas(i: int, gen: Generation) -> AsyncIterator[tuple[int, ChoiceDelta, str | None]]:
            output = outputs[i]
            async for event in self.events(gen):
                delta = output.feed(event)
                if not delta.empty or event.finish_reason is not None:
                    yield i, delta, output.finish_reason(event.finish_reason)

        def choice(item: tuple[int, ChoiceDelta, str | None]) -> dict[str, Any]:
            i, delta, finish = item
            logprobs = {"content": delta.logprobs} if request.top_logprobs is not None else None
            return {"index": i, "delta": delta.as_delta(), "finish_reason": finish, "logprobs": logprobs}

        usage = (lambda: _chat_usage(gens[0].num_prompt_tokens, outputs)) if request.include_usage else None
        async for chunk in sse_choices(gens, interleaved([deltas(i, gen) for i, gen in enumerate(gens)]),
                                       envelope, choice, usage):
            yield chunk


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
    return usage_of(prompt_tokens, sum(o.num_tokens for o in outputs)) | {
        "prompt_tokens_details": {"cached_tokens": cached or 0},
    }


def media_cache_headers(prompt: ChatPrompt) -> dict[str, str]:
    """How many of the prompt's media the embedding cache had: a client can
    tell a repeated upload was not encoded again."""
    hits = sum(emb.cached for emb in prompt.media)
    return {"x-swallow-media-cache": f"hits={hits}; items={len(prompt.media)}"}


async def with_sound_tracks(
    messages: list[dict[str, Any]], refs: list[MediaRef]
) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """A video with a sound track is heard too (for a model that takes audio): its
    track becomes an audio part right after the video part, and both items
    carry the file's digest, so its bytes are hashed once."""
    if not any(r.kind == "video" for r in refs):
        return messages, refs
    loop = asyncio.get_running_loop()
    tracks = await asyncio.gather(*(
        loop.run_in_executor(None, _sound_track_digest, r) if r.kind == "video" else _none() for r in refs
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
            ref, digest = next(pending)
            if digest is None:
                out_refs.append(ref)
                continue
            parts.append({"type": "audio"})
            out_refs += [replace(ref, digest=digest), MediaRef("audio", data=ref.data, path=ref.path, digest=digest)]
        out_messages.append({**message, "content": parts})
    return out_messages, out_refs


async def _none() -> None:
    return None


def _sound_track_digest(ref: MediaRef) -> bytes | None:
    """The clip's ``file_digest`` when it has a sound track (both of its items
    are then keyed by it), else None."""
    source = ref.path if ref.path is not None else ref.read()
    if not has_audio_track(source):
        return None
    return ref.digest if ref.digest is not None else file_digest(source)


def sse_error(exc: RequestFailed | EngineUnavailable) -> str:
    """A failure after the 200 was sent can only travel inside the stream: the
    same error object the status line would have carried."""
    answer = error_for(exc)
    assert answer is not None  # both kinds are mapped
    return f"data: {answer.body.decode()}\n\n"


def _chat_envelope(request_id: str, model: str, kind: str) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model}


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def sse_choices(gens: list[Generation], items: AsyncIterator[Any], envelope: dict[str, Any],
                      choice: Callable[[Any], dict[str, Any]],
                      usage: Callable[[], dict[str, int]] | None) -> AsyncIterator[str]:
    """A streamed answer's events: one chunk per item (``choice`` makes its
    choice), a failure as an error event, the usage chunk when asked, then
    [DONE]. The generations are closed however the stream ends."""
    try:
        async with contextlib.aclosing(items) as each:
            async for item in each:
                yield sse(envelope | {"choices": [choice(item)]})
    except (RequestFailed, EngineUnavailable) as exc:
        yield sse_error(exc)
    finally:
        for gen in gens:
            await gen.stream.aclose()
    if usage is not None:
        yield sse(envelope | {"choices": [], "usage": usage()})
    yield "data: [DONE]\n\n"


async def interleaved(sources: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
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
            await gather_or_cancel([pump(source) for source in sources])
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


async def gather_or_cancel(aws: list[Awaitable[Any]]) -> list[Any]:
    """Every result; when one fails the others are cancelled, and awaited, before
    the failure is raised (plain gather leaves them running)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
