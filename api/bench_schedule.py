"""``swallow bench schedule``: schedule policies on trace replay.

The replay (``llm_core/bench/schedule.py``) runs the engine's scheduler,
pools and prefix cache on a virtual clock; this module supplies the
``calibrated`` cost model, measured on this machine: the real engine's step
time on the demo model's shape (random weights, float32, CPU) over prefill
chunks at several contexts and decode batches of several sizes, fitted as a
linear model of the step's features.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from api.demo.train import demo_llm_config
from llm_core import LLM, SamplingParams
from llm_core.bench.schedule import AnalyticCost, LinearCost, StepShape, plot_cdf, schedule_bench, step_shape
from llm_core.checkpoint import write_random_checkpoint
from llm_core.presets import mimo_v2_5_pro
from llm_core.scheduler import ScheduledChunk

__all__ = ["calibrated_cost", "cost_model", "run_schedule_bench"]

VOCAB = 431
PREFILL_CHUNKS = (16, 64, 256, 1024)
PREFILL_CONTEXT = 3072
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (64, 512, 2048)


def _timed_steps(llm: LLM, steps: int) -> list[tuple[StepShape, float]]:
    """Run ``steps`` engine steps; each one's shape and wall time."""
    engine = llm.engine
    window = engine.window
    captured: list[list[ScheduledChunk]] = []
    schedule = engine.scheduler.schedule

    def capture() -> list[ScheduledChunk]:
        captured.append(schedule())
        return captured[-1]

    engine.scheduler.schedule = capture  # type: ignore[method-assign]
    samples = []
    try:
        for _ in range(steps):
            if not engine.scheduler.has_unfinished():
                break
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            if captured and captured[-1]:
                samples.append((step_shape(captured[-1], window), seconds))
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    return samples


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def calibrated_cost(log: Callable[[str], None] | None = None) -> LinearCost:
    """The engine's step time on this machine, fitted (see the module doc)."""
    say = log or (lambda _msg: None)
    rng = random.Random(0)
    samples: list[tuple[StepShape, float]] = []
    with tempfile.TemporaryDirectory(prefix="swallow-bench-schedule-") as tmp:
        config = dataclasses.replace(demo_llm_config(VOCAB, 1), max_position_embeddings=8192)
        model = write_random_checkpoint(Path(tmp) / "model", config, seed=0)
        for chunk in PREFILL_CHUNKS:
            say(f"calibrating: prefill chunks of {chunk}")
            llm = LLM(model, enable_prefix_caching=False, chunked_prefill_size=chunk, max_num_batched_tokens=chunk,
                      speculative_tokens=0)
            llm.generate([_prompt(rng, 64)], SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up
            llm.engine.add_request(_prompt(rng, PREFILL_CONTEXT + chunk), SamplingParams(max_tokens=1, ignore_eos=True))
            samples += _timed_steps(llm, PREFILL_CONTEXT // chunk + 2)
        for context in DECODE_CONTEXTS:
            for batch in DECODE_BATCHES:
                say(f"calibrating: decode of {batch} rows at {context}")
                llm = LLM(model, enable_prefix_caching=False, max_running_requests=max(DECODE_BATCHES),
                          chunked_prefill_size=4096, max_num_batched_tokens=4096, speculative_tokens=0)
                for _ in range(batch):
                    llm.engine.add_request(_prompt(rng, context), SamplingParams(max_tokens=12, ignore_eos=True))
                while any(not s.in_decode for s in llm.engine.scheduler.running) or llm.engine.scheduler.waiting:
                    llm.engine.step()  # the prefills, untimed
                samples += [s for s in _timed_steps(llm, 10) if s[0].prefill_tokens == 0][2:]
    return LinearCost.fit(samples)


def cost_model(name: str, log: Callable[[str], None] | None = None) -> AnalyticCost | LinearCost:
    if name == "mimo-v2.5-pro-h200":
        return AnalyticCost.for_preset(mimo_v2_5_pro())
    if name == "calibrated":
        return calibrated_cost(log)
    raise ValueError(f"unknown cost model {name!r}; choose mimo-v2.5-pro-h200 or calibrated")


def run_schedule_bench(trace: str, cost: str, load: float, limit: int | None, plot: str | None,
                       log: Callable[[str], None] | None = None) -> dict[str, Any]:
    result = schedule_bench(trace, cost_model(cost, log), load, limit=limit, log=log)
    cdfs = result.pop("_cdfs")
    if plot:
        plot_cdf(cdfs, plot, f"TTFT on {Path(trace).name} at {load:.0%} load ({cost})")
        result["plot"] = plot
    return result
