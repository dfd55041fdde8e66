"""The calibrated cost model (the engine's steps, timed and fitted) and the
real-engine replay of a scaled-down agentic trace."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bench.schedule import VOCAB, calibrated_cost, engine_replay, scaled_trace
from demo.model import demo_llm_config
from llm_core import LLM
from bench.prefix_cache import load_trace
from bench.replay_cost import StepShape
from llm_core.loading.checkpoint import write_random_checkpoint


def test_the_calibrated_model_grows_with_prefill_tokens_and_decode_rows() -> None:
    # Sizes far apart: timings on a busy machine are noisy, and the fit must still see the growth.
    cost = calibrated_cost(chunks=(16, 256), context=512, batches=(1, 16), contexts=(64,))
    assert cost.intercept >= 0 and all(c >= 0 for c in cost.coefficients)
    small = cost.step_seconds(StepShape(16, 16 * 8, 16 * 8))
    large = cost.step_seconds(StepShape(512, 512 * 256, 512 * 32))
    assert 0 < small < large
    assert cost.step_seconds(StepShape(decode_rows=8, decode_context=512)) > 0


def _sessions(path: Path) -> Path:
    for k in range(2):
        requests, ids = [], []
        for t in range(3):
            ids = ids + [len(ids) + j for j in range(4)]
            requests.append({"t": 1.0 * t, "type": "n", "in": 64 * len(ids) + 10, "out": 40, "hash_ids": ids})
        (path / f"trace_{k:04d}.json").write_text(json.dumps(
            {"id": k, "block_size": 64, "hash_id_scope": "local", "requests": requests}))
    return path


def test_the_engine_replay_serves_every_request_in_session_order(tmp_path: Path) -> None:
    requests = scaled_trace(load_trace(_sessions(tmp_path), stagger_s=0.0), sessions=2, turns=3)
    assert len(requests) == 6 and {r.block_size for r in requests} == {8}
    config = dataclasses.replace(demo_llm_config(VOCAB, 1), max_position_embeddings=512)
    model = write_random_checkpoint(tmp_path / "model", config, seed=0)
    llm = LLM(model, page_size=8, speculative_tokens=0)
    steps: list[tuple[StepShape, float]] = []
    times = engine_replay(llm, requests, time_scale=0.05, steps=steps)
    # Every step it ran is recorded for the replay's cost model: all prompt tokens not cached, one row per output.
    assert sum(shape.prefill_tokens for shape, _ in steps) <= sum(t.prompt_tokens for t in times)
    assert sum(shape.rows for shape, _ in steps) >= sum(t.output_tokens for t in times)
    assert all(seconds > 0 for _, seconds in steps)
    assert len(times) == 6 and all(t.first_token is not None and t.finished is not None for t in times)
    assert all(t.first_token >= t.arrival for t in times)  # type: ignore[operator]
    # A session's next turn is sent only once its previous one is answered:
    # before the first answer, only the two sessions' first turns are out.
    first_answer = min(t.finished for t in times)  # type: ignore[type-var]
    assert sum(t.arrival < first_answer for t in times) == 2
