"""AsyncEngine: the engine on its own thread, driven from asyncio."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from api.engine_loop import AsyncEngine
from api.streams import EngineOverloaded, EngineUnavailable, RequestFailed
from api.textstream import TextStream
from llm_core import LLM, SamplingParams


def _run(coro):  # noqa: ANN001, ANN202
    return asyncio.run(coro)


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [event.token async for event in engine.generate(prompt, params)]


def _wait_for(predicate, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _idle_at_capacity(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return (s["running_requests"] == 0 and s["full_pool"]["free_tokens"] == s["full_pool"]["capacity_tokens"]
            and s["swa_pool"]["free_tokens"] == s["swa_pool"]["capacity_tokens"])


def test_concurrent_requests_match_offline_generation(tiny_checkpoint: Path) -> None:
    prompts = [list(range(10, 10 + n)) for n in (5, 40, 17, 90)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(tiny_checkpoint).generate(prompts, params)]
    engine = AsyncEngine(LLM(tiny_checkpoint))

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(_collect(engine, p, params) for p in prompts)))

    try:
        assert _run(main()) == expected
    finally:
        engine.close()


def test_leaving_early_aborts_and_frees_kv(tiny_checkpoint: Path) -> None:
    llm = LLM(tiny_checkpoint, enable_prefix_caching=False)
    engine = AsyncEngine(llm)

    async def main() -> int:
        got = 0
        async for _ in engine.generate(list(range(5, 60)), SamplingParams(max_tokens=2000, ignore_eos=True)):
            got += 1
            if got == 3:
                break
        return got

    try:
        assert _run(main()) == 3

        _wait_for(lambda: _idle_at_capacity(engine))
        assert engine.pending == 0
    finally:
        engine.close()


def test_cancelled_task_aborts(tiny_checkpoint: Path) -> None:
    engine = AsyncEngine(LLM(tiny_checkpoint, enable_prefix_caching=False))

    async def main() -> None:
        task = asyncio.ensure_future(_collect(engine, list(range(5, 30)), SamplingParams(max_tokens=5000,
                                                                                          ignore_eos=True)))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        _run(main())
        _wait_for(lambda: _idle_at_capacity(engine))
    finally:
        engine.close()


def test_overload_and_refused_requests(tiny_checkpoint: Path) -> None:
    engine = AsyncEngine(LLM(tiny_checkpoint, kv_budget_bytes=1 << 20), max_pending=1)

    async def main() -> None:
        first = engine.generate([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
        await first.__anext__()
        with pytest.raises(EngineOverloaded, match="capacity"):
            await engine.generate([1, 2], SamplingParams(max_tokens=2)).__anext__()
        await first.aclose()
        # Validation failures inside the engine reach the caller as ValueError.
        with pytest.raises(ValueError, match="more KV memory"):
            await _collect(engine, [5] * 3000, SamplingParams(max_tokens=10))
        assert await _collect(engine, [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))

    try:
        _run(main())
    finally:
        engine.close()


def test_close_fails_what_is_running(tiny_checkpoint: Path) -> None:
    engine = AsyncEngine(LLM(tiny_checkpoint))

    async def main() -> None:
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=100000 // 100, ignore_eos=True))
        await stream.__anext__()
        engine.close()
        with pytest.raises(RuntimeError, match="shutting down"):
            async for _ in stream:
                pass

    _run(main())


def test_refusals_come_from_open_before_any_token(tiny_checkpoint: Path) -> None:
    engine = AsyncEngine(LLM(tiny_checkpoint, enable_prefix_caching=False))

    async def main() -> None:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.open([5, 6], SamplingParams(max_tokens=3, stop_token_ids=[10**7]))
        stream = await engine.open([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len([e async for e in stream]) == 3
        # Opened and never read: closing it still frees its KV.
        unread = await engine.open(list(range(5, 50)), SamplingParams(max_tokens=500, ignore_eos=True))
        await unread.aclose()
        assert engine.pending == 0

    try:
        _run(main())
        _wait_for(lambda: _idle_at_capacity(engine))
    finally:
        engine.close()


def test_one_requests_failure_leaves_the_others_alone(tiny_checkpoint: Path) -> None:
    from tests.llm_core.test_engine_faults import _bad_span

    llm = LLM(tiny_checkpoint, enable_prefix_caching=False)
    prompts = [list(range(10, 10 + n)) for n in (5, 40, 17, 90)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    engine = AsyncEngine(llm)

    async def doomed() -> None:
        stream = await engine.open(list(range(60, 100)), params, [_bad_span(llm, 3, 10)])
        async for _ in stream:
            pass

    async def main() -> list:
        return list(await asyncio.gather(*(_collect(engine, p, params) for p in prompts), doomed(),
                                         return_exceptions=True))

    try:
        *good, failure = _run(main())
        assert isinstance(failure, RequestFailed) and "injected fault" in str(failure)
        assert good == expected
        _wait_for(lambda: _idle_at_capacity(engine))
    finally:
        engine.close()


def test_a_fault_no_request_explains_fails_all_and_the_engine_restarts(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(tiny_checkpoint)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = llm.generate([[5, 6, 7]], params)[0].token_ids
    broken_engine = llm.engine
    real_step = broken_engine.step

    def step() -> list:
        if len(broken_engine.scheduler.running) >= 2:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(broken_engine, "step", step)
    engine = AsyncEngine(llm)

    async def main() -> tuple[list, list[int]]:
        failed = await asyncio.gather(*(_collect(engine, [5, 6, 7 + i], params) for i in range(3)),
                                      return_exceptions=True)
        return failed, await _collect(engine, [5, 6, 7], params)

    try:
        failed, after = _run(main())
        assert all(isinstance(f, EngineUnavailable) and "device lost" in str(f) for f in failed)
        assert llm.engine is not broken_engine
        assert after == expected
    finally:
        engine.close()


def test_flush_cache_runs_on_the_engine_thread(tiny_checkpoint: Path) -> None:
    engine = AsyncEngine(LLM(tiny_checkpoint))

    async def main() -> dict:
        await _collect(engine, list(range(5, 70)), SamplingParams(max_tokens=4, ignore_eos=True))
        return await engine.flush_cache()

    try:
        stats = _run(main())
        assert stats["prefix_cache"]["nodes"] <= 1  # only the root is left
        assert stats["full_pool"]["free_tokens"] == stats["full_pool"]["capacity_tokens"]
    finally:
        engine.close()


def test_text_is_decoded_on_the_engine_thread_and_a_stop_string_ends_the_request_there(
    tiny_checkpoint: Path,
) -> None:
    llm = LLM(tiny_checkpoint, enable_prefix_caching=False)
    prompt, params = list(range(5, 30)), SamplingParams(max_tokens=60, ignore_eos=True)
    free = llm.generate([prompt], params)[0]
    stop = llm.tokenizer.decode(free.token_ids[20:23])  # a stop a few tokens long, found at about token 23
    cut = free.text.find(stop)
    assert stop and cut >= 0
    engine = AsyncEngine(llm)
    threads: set[str] = set()

    class Recording(TextStream):
        def push(self, token: int, final: bool = False) -> str:
            threads.add(threading.current_thread().name)
            return super().push(token, final)

    async def main() -> list:
        text = Recording(llm.tokenizer.stream_decoder(), [stop])
        return [e async for e in engine.generate(prompt, params, text=text)]

    try:
        events = _run(main())
        assert "".join(e.text for e in events) == free.text[:cut]
        assert events[-1].finish_reason == "stop" and len(events) <= 23
        assert [e.token for e in events] == free.token_ids[: len(events)]
        assert threads == {"swallow-engine"}
        _wait_for(lambda: _idle_at_capacity(engine))
    finally:
        engine.close()


def test_an_inline_engine_steps_on_the_event_loop_and_sinks_in_order(tiny_checkpoint: Path) -> None:
    """``inline=True`` (an engine-core process): no engine thread; ``run_inline``
    steps on the loop. Sinks see the admission first, then every token, and the
    loop still serves other work between steps; a cancelled stream is freed."""
    prompts = [list(range(10, 10 + n)) for n in (5, 40, 17, 90)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(tiny_checkpoint).generate(prompts, params)]
    engine = AsyncEngine(LLM(tiny_checkpoint, enable_prefix_caching=False), inline=True)
    assert engine._thread is None

    async def sunk(prompt: list[int]) -> list[object]:
        seen: list[object] = []
        stream = await engine.open(prompt, params, sink=lambda e: seen.append("admitted" if e is None else e.token))
        assert seen[:1] == ["admitted"]  # first, before open returns (tokens may follow already)
        async for _ in stream:
            raise AssertionError("a sink stream yields nothing")
        return seen

    async def main() -> tuple[list[list[object]], int]:
        runner = asyncio.create_task(engine.run_inline())
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        got = await asyncio.gather(*(sunk(p) for p in prompts))
        long = asyncio.create_task(_collect(engine, list(range(5, 30)), SamplingParams(max_tokens=5000,
                                                                                        ignore_eos=True)))
        await asyncio.sleep(0.2)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        for _ in range(200):
            await asyncio.sleep(0.01)
            if _idle_at_capacity(engine):
                break
        ticker.cancel()
        engine.close()
        await asyncio.wait_for(runner, 10)
        return got, ticks

    got, ticks = _run(main())
    assert [seen[1:] for seen in got] == expected
    assert ticks > 20  # the loop ran its other tasks between the steps
    assert _idle_at_capacity(engine) and engine.pending == 0


def test_submit_queues_a_request_for_the_very_next_step(tiny_checkpoint: Path) -> None:
    """``submit`` awaits nothing: the engine's next turn admits and prefills the
    request, with no loop turn between. ``admitted`` then hands over its stream."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    expected = LLM(tiny_checkpoint).generate([list(range(10, 30))], params)[0].token_ids
    engine = AsyncEngine(LLM(tiny_checkpoint, enable_prefix_caching=False), inline=True)

    async def main() -> list[int]:
        seen: list[object] = []
        submission = engine.submit(list(range(10, 30)), params,
                                   sink=lambda e: seen.append("admitted" if e is None else e.token))
        assert engine.pending == 1
        assert engine._turn() == "stepped"  # no await since submit: admitted and prefilled already
        assert seen == ["admitted", expected[0]]
        stream = await submission.admitted()
        while engine._turn() == "stepped":
            pass
        async for _ in stream:
            raise AssertionError("a sink stream yields nothing")
        submission.release()  # after the stream ended: nothing more to do
        return seen[1:]

    assert _run(main()) == expected
    assert engine.pending == 0 and _idle_at_capacity(engine)
    engine.close()


def test_a_released_submission_is_dropped_whether_or_not_it_was_admitted(tiny_checkpoint: Path) -> None:
    """``release`` without ``admitted`` (a task cancelled before it ran): the
    request stops counting as pending and the engine drops it, freeing its KV."""
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine = AsyncEngine(LLM(tiny_checkpoint, enable_prefix_caching=False), inline=True)

    async def main() -> None:
        before = engine.submit(list(range(10, 30)), params)
        before.release()  # before the engine saw it: queued behind its admission, aborted right after
        assert engine.pending == 0
        engine._turn()
        running = engine.submit(list(range(10, 40)), params)
        engine._turn()
        assert engine.llm.stats()["running_requests"] == 1
        running.release()  # admitted and running: aborted
        running.release()
        assert engine.pending == 0
        engine._turn()
        engine._publish_stats(force=True)

    _run(main())
    assert _idle_at_capacity(engine)
    engine.close()


def test_a_reader_stopping_at_the_last_token_queues_no_abort(tiny_checkpoint: Path) -> None:
    """Closing a stream on its final event (as the HTTP handlers do) queues no
    abort for the engine: the request ended there already."""
    engine = AsyncEngine(LLM(tiny_checkpoint, enable_prefix_caching=False), inline=True)

    async def main() -> None:
        submission = engine.submit(list(range(10, 30)), SamplingParams(max_tokens=2, ignore_eos=True))
        while engine._turn() == "stepped":
            pass
        stream = await submission.admitted()
        async for event in stream:
            if event.finish_reason is not None:
                break
        await stream.aclose()
        assert engine._commands.empty() and engine.pending == 0

    _run(main())
    engine.close()


def test_the_apis_request_id_names_the_request_in_the_engine_loops_log(tiny_checkpoint: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    engine = AsyncEngine(LLM(tiny_checkpoint, enable_prefix_caching=False))

    async def main() -> None:
        stream = await engine.open([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), request_id="cmpl-abc")
        assert len([e async for e in stream]) == 2

    try:
        with caplog.at_level("DEBUG", logger="api.engine_loop"):
            _run(main())
    finally:
        engine.close()
    assert any(r.getMessage().startswith("request cmpl-abc is engine request ") for r in caplog.records)
