"""admitted_stream: when a request's stream is over, the same rule for every engine behind it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from api.streams import RequestFailed, StreamEvent, admitted_stream


def _source(items: list[object], then: BaseException | None = None,
            gate: asyncio.Event | None = None) -> AsyncGenerator[StreamEvent | None, None]:
    async def gen() -> AsyncGenerator[StreamEvent | None, None]:
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
        if gate is not None:
            await gate.wait()
        if then is not None:
            raise then
    return gen()


def _events(n: int, last: str | None = "length") -> list[object]:
    return [StreamEvent(i, last if i == n - 1 else None) for i in range(n)]


async def _open(items: list[object], releases: list[bool], **kw: object) -> AsyncGenerator[StreamEvent, None]:
    return await admitted_stream(_source(items, **kw), releases.append)  # type: ignore[arg-type]


def test_a_stream_read_to_its_last_event_is_finished() -> None:
    async def main() -> list[bool]:
        releases: list[bool] = []
        stream = await _open([None, *_events(3)], releases)
        assert releases == []  # admitted, held by the engine
        assert [e.token async for e in stream] == [0, 1, 2]
        return releases

    assert asyncio.run(main()) == [True]


def test_closing_at_the_last_event_aborts_nothing_and_before_it_aborts() -> None:
    async def main() -> tuple[list[bool], list[bool]]:
        at_last: list[bool] = []
        stream = await _open([None, *_events(2)], at_last)
        assert (await stream.__anext__()).finish_reason is None
        assert (await stream.__anext__()).finish_reason == "length"
        await stream.aclose()
        early: list[bool] = []
        stream = await _open([None, *_events(5)], early)
        await stream.__anext__()
        await stream.aclose()
        await stream.aclose()  # released once
        return at_last, early

    assert asyncio.run(main()) == ([True], [False])


def test_a_refusal_raises_at_open_and_a_failure_in_the_stream() -> None:
    async def main() -> tuple[list[bool], list[bool]]:
        refused: list[bool] = []
        with pytest.raises(ValueError, match="too long"):
            await _open([ValueError("prompt too long")], refused)
        failed: list[bool] = []
        stream = await _open([None, StreamEvent(7, None)], failed, then=RequestFailed("boom"))
        with pytest.raises(RequestFailed, match="boom"):
            async for _ in stream:
                pass
        return refused, failed

    assert asyncio.run(main()) == ([True], [True])  # the engine holds neither


def test_a_cancelled_reader_leaves_the_request_unfinished() -> None:
    async def main() -> list[bool]:
        releases: list[bool] = []
        stream = await _open([None, StreamEvent(1, None)], releases, gate=asyncio.Event())

        async def read() -> None:
            async for _ in stream:
                pass

        task = asyncio.create_task(read())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return releases

    assert asyncio.run(main()) == [False]


def test_an_async_release_is_awaited() -> None:
    async def main() -> list[bool]:
        released: list[bool] = []

        async def release(finished: bool) -> None:
            await asyncio.sleep(0)
            released.append(finished)

        stream = await admitted_stream(_source([None, *_events(1)]), release)
        assert [e.token async for e in stream] == [0]
        return released

    assert asyncio.run(main()) == [True]
