"""What a worker's engine steps did for its APIs' requests, on its way to them:
one ``StepOutputs`` frame per API and loop turn (``Outbox``), a stream's
events as the ``Tokens`` that carry them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from api.streams import StreamEvent
from api.stack import messages as m

__all__ = ["Outbox", "tokens_message"]


class Outbox:
    """Outputs for APIs, sent as one ``StepOutputs`` frame per API and loop
    turn. The engine hands a step's tokens over in one callback, so every
    stream it advanced queues here in the same turn, and the flush (a task,
    so the turn after) sends them together; a request's consecutive tokens
    become one ``Tokens``."""

    def __init__(self, send: Callable[[bytes, object], Awaitable[bool]]) -> None:
        self._send = send
        self._queued: dict[bytes, list[m.RequestOutput]] = {}
        self._flush_task: asyncio.Task[None] | None = None

    def put(self, identity: bytes, output: m.RequestOutput) -> None:
        queued = self._queued.setdefault(identity, [])
        if queued and _mergeable(queued[-1], output):
            output = _merged(queued.pop(), output)  # type: ignore[arg-type]
        queued.append(output)
        if self._flush_task is None:
            self._flush_task = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        self._flush_task = None  # what is queued from here goes in the next frame
        queued, self._queued = self._queued, {}
        for identity, outputs in queued.items():
            await self._send(identity, m.StepOutputs(outputs))


def _mergeable(last: m.RequestOutput, new: m.RequestOutput) -> bool:
    return (isinstance(last, m.Tokens) and isinstance(new, m.Tokens) and last.request_id == new.request_id
            and last.finish_reason is None and (last.logprobs is None) == (new.logprobs is None))


def _merged(first: m.Tokens, then: m.Tokens) -> m.Tokens:
    logprobs = None if first.logprobs is None else [*first.logprobs, *(then.logprobs or [])]
    top = None if first.top_logprobs is None else [*first.top_logprobs, *(then.top_logprobs or [])]
    return m.Tokens(first.request_id, [*first.tokens, *then.tokens], then.finish_reason, logprobs, top,
                    first.cached_tokens)


def tokens_message(request_id: str, event: StreamEvent) -> m.Tokens:
    if event.logprob is None:
        return m.Tokens(request_id, [event.token], event.finish_reason, cached_tokens=event.cached_tokens)
    return m.Tokens(request_id, [event.token], event.finish_reason, [event.logprob],
                    [list(event.top_logprobs)], event.cached_tokens)
