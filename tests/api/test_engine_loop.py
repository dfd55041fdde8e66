"""AsyncEngine: the engine on its own thread, driven from asyncio."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from api.engine_loop import AsyncEngine, EngineOverloaded
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

        def idle() -> bool:
            s = engine.stats()
            return (s["running_requests"] == 0 and s["full_pool"]["free_tokens"] == s["full_pool"]["capacity_tokens"]
                    and s["swa_pool"]["free_tokens"] == s["swa_pool"]["capacity_tokens"])

        _wait_for(idle)
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
        _wait_for(lambda: engine.stats()["running_requests"] == 0)
        s = engine.stats()
        assert s["full_pool"]["free_tokens"] == s["full_pool"]["capacity_tokens"]
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
