"""Legacy text completions (`/v1/completions`): prompts as text or token ids,
n choices each, streamed per step or answered whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from api.chat import (
    BadRequest, choice_request_id, new_request_id, parse_bool, parse_choices, parse_include_usage, parse_int,
    parse_sampling, parse_stop, require_unicode,
)
from api.chat_service import ChatService, Generation, gather_or_cancel, interleaved, sse_choices, usage_of
from api.streams import StreamEvent
from llm_core import SamplingParams
from llm_core.sample.params import MAX_TOP_LOGPROBS

__all__ = ["CompletionRequest", "CompletionService"]


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
                first = await self.chat.open(ids, params, [], request.stop,
                                             choice_request_id(request.request_id, len(opened)))
                opened.append(first)
                if request.n == 1:
                    continue
                opened[-1] = await first.peeked()
                for j in range(1, request.n):
                    seed = None if params.seed is None else (params.seed + j) % (1 << 64)
                    opened.append(await self.chat.open(ids, replace(params, seed=seed), [], request.stop,
                                                       choice_request_id(request.request_id, len(opened))))
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

    async def complete(self, request: CompletionRequest, gens: list[Generation]) -> dict:
        try:
            results = await gather_or_cancel([self._one(gen) for gen in gens])
        finally:
            for gen in gens:  # one failed: the others' work is this client's, and it gets an error
                await gen.stream.aclose()
        choices = [
            {"index": i, "text": r["text"], "token_ids": r["token_ids"], "logprobs": r["logprobs"],
             "finish_reason": r["finish_reason"]}
            for i, r in enumerate(results)
        ]
        total = sum(len(r["token_ids"]) for r in results)
        return _completion_envelope(request.request_id, self.chat.model.name) | {
            "choices": choices,
            "usage": usage_of(_prompt_tokens(gens, request.n), total),
        }

    async def stream(self, request: CompletionRequest, gens: list[Generation]) -> AsyncIterator[str]:
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

        def choice(item: tuple[int, str, str | None, list[int], dict[str, Any] | None]) -> dict[str, Any]:
            i, delta, finish, new_tokens, logprobs = item
            counts[i] += len(new_tokens)
            return {"index": i, "text": delta, "token_ids": new_tokens, "logprobs": logprobs,
                    "finish_reason": finish}

        envelope = _completion_envelope(request.request_id, self.chat.model.name)  # one id for the whole stream
        sources = [pieces(i, gen) for i, gen in enumerate(gens)]
        usage = (lambda: usage_of(_prompt_tokens(gens, request.n), sum(counts))) if request.include_usage else None
        # One choice needs no interleaving (and none of its per-token hops).
        async for chunk in sse_choices(gens, sources[0] if len(sources) == 1 else interleaved(sources), envelope,
                                       choice, usage):
            yield chunk


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[list[int]]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1
    request_id: str = field(default_factory=lambda: new_request_id("cmpl"))  # as ChatRequest.request_id


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


def _completion_envelope(request_id: str, model: str) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
