"""Host-side cost of one decode step -- scheduling and batch metadata, the
forward excluded -- at 64 running requests and growing contexts.

The engine runs on the ``meta`` device: pools and weights of a real model
shape cost nothing, tensors have shapes but no data, so what is timed is the
host work a GPU would wait on. Prefill is fast-forwarded through the
allocator. The baseline, timed in the same run on the same requests,
adds what a step cost on top when every request's full-pool slot list was
rebuilt each step (the engine before block tables; a lower bound, as it also
padded them into a [batch, longest] table): that part grows with the context.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from llm_core.engine import Engine, EngineConfig
from llm_core.model_runner import page_slots
from llm_core.model.model import MiMoV2ForCausalLM
from llm_core.kv.paged_attention import KVCacheTensors
from llm_core.model.presets import PRESETS
from llm_core.sample.params import SamplingParams
from llm_core.sched.scheduler import ScheduledChunk, Sequence

DEFAULT_CONTEXTS = (1024, 8192, 32768)
_PREFILL_TOKENS = 16384  # per fast-forward step: prefill is not what is measured
_WARMUP_STEPS = 5


def step_bench(
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    running: int = 64,
    steps: int = 50,
    preset: str = "mimo-v2-flash",
) -> dict[str, Any]:
    config = PRESETS[preset]()
    config = replace(config, max_position_embeddings=max(config.max_position_embeddings, max(contexts) + steps + 64))
    with torch.device("meta"):
        model = MiMoV2ForCausalLM(config)
    result: dict[str, Any] = {"preset": preset, "running_requests": running, "decode_steps": steps}
    for context in contexts:
        engine = _engine_at(model, context, running, steps + _WARMUP_STEPS)
        _time_decode_steps(engine, _WARMUP_STEPS)
        gc.collect()  # the previous context's garbage must not be collected inside this one's timing
        setup, baseline = _time_decode_steps(engine, steps)
        del engine
        label = _label(context)
        result[f"setup_ms_{label}"] = round(setup, 3)
        result[f"baseline_setup_ms_{label}"] = round(baseline, 3)
    first, last = _label(contexts[0]), _label(contexts[-1])
    result[f"ratio_{last}_{first}"] = round(result[f"setup_ms_{last}"] / result[f"setup_ms_{first}"], 3)
    result[f"baseline_ratio_{last}_{first}"] = round(
        result[f"baseline_setup_ms_{last}"] / result[f"baseline_setup_ms_{first}"], 3
    )
    return result


def _label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def _engine_at(model: MiMoV2ForCausalLM, context: int, running: int, steps: int) -> Engine:
    """An engine on ``meta`` whose ``running`` requests have just finished a
    ``context``-token prefill."""
    probe = KVCacheTensors(model.config, 0, 0, torch.float32, "meta")
    window = model.config.sliding_attention.sliding_window or 1
    full_tokens = running * (context + steps + 64)
    swa_tokens = running * (window + 32) + _PREFILL_TOKENS
    budget = full_tokens * probe.full_bytes_per_token + swa_tokens * probe.swa_bytes_per_token
    config = EngineConfig(kv_budget_bytes=budget, max_running_requests=running,
                          max_num_batched_tokens=_PREFILL_TOKENS, chunked_prefill_size=_PREFILL_TOKENS,
                          speculative_tokens=0)
    engine = Engine(model, config, torch.device("meta"))
    vocab = model.config.vocab_size
    for i in range(running):
        prompt = [(i * 7919 + j * 31) % (vocab - 3) + 3 for j in range(context)]
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    scheduler = engine.scheduler
    for seq in list(scheduler.waiting):
        scheduler.waiting.remove(seq)
        _prefilled(engine, seq)
    return engine


def _prefilled(engine: Engine, seq: Sequence) -> None:
    """Leave ``seq`` as its prefill would (pages held, the window's SWA slots,
    one token sampled) without scheduling it: scheduled, the requests already
    decoding would keep growing while the others prefill."""
    allocator = engine.allocator
    for end in range(_PREFILL_TOKENS, len(seq.prompt) + _PREFILL_TOKENS, _PREFILL_TOKENS):
        allocator.grow(seq.view, min(end, len(seq.prompt)))
        seq.num_computed = seq.view.num_tokens
        allocator.release_out_of_window(seq.view, seq.num_computed)
    seq.output.append(3)
    engine.scheduler.running.append(seq)
    seq.is_running = True


def _advance(engine: Engine, chunks: list[ScheduledChunk]) -> None:
    """After a step: what sampling would have appended (one token per finished chunk)."""
    engine.scheduler.advance(chunks)
    for chunk in chunks:
        if chunk.samples:
            chunk.seq.output.append(3)


def _time_decode_steps(engine: Engine, steps: int) -> tuple[float, float]:
    """Median ms per decode step: (schedule + metadata now, the same with the
    old per-step slot lists of every request's whole context)."""
    now, before = [], []
    for _ in range(steps):
        start = time.perf_counter()
        chunks = engine.scheduler.schedule()
        engine.runner.prepare_step(chunks)
        now.append(time.perf_counter() - start)
        start = time.perf_counter()
        _rebuilt_slot_lists(chunks)
        before.append(now[-1] + time.perf_counter() - start)
        _advance(engine, chunks)
    return statistics.median(now) * 1e3, statistics.median(before) * 1e3


def _rebuilt_slot_lists(chunks: list[ScheduledChunk]) -> torch.Tensor:
    """What the engine did per step before block tables: every request's full
    slot list, positions 0..end, concatenated (the metadata it then uploaded)."""
    lists = [
        page_slots(chunk.seq.view.full_pages, 0, chunk.seq.view.full_page_size, 0, chunk.start + chunk.length)
        for chunk in chunks
    ]
    return torch.cat(lists)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--running", type=int, default=64, help="running requests")
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per context")
    parser.add_argument("--preset", default="mimo-v2-flash", help="model shape")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return step_bench(running=args.running, steps=args.steps, preset=args.preset)
