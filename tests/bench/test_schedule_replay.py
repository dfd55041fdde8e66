"""Schedule replay: the cost models, load scaling, the policies' TTFT on a
trace with short and long requests, and the bench command's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swallow.cli import main
from bench.prefix_cache import TraceRequest
from bench.replay_cost import AnalyticCost, LinearCost, StepShape
from bench.replay_load import calibrate_load, utilisation
from bench.schedule_replay import ReplayConfig, replay, summarize
from llm_core.model.presets import mimo_v2_5_pro

COST = AnalyticCost.for_preset(mimo_v2_5_pro())


def _mixed(n: int = 240, seed: int = 1) -> list[TraceRequest]:
    """Mostly short prompts, one in ten 30-60K tokens, each with its own blocks."""
    import random

    rng = random.Random(seed)
    out, block = [], 0
    for i in range(n):
        tokens = rng.randrange(20_000, 60_000) if i % 10 == 3 else rng.randrange(500, 4_000)
        blocks = tuple(("", block + k) for k in range(tokens // 512))
        block += len(blocks)
        out.append(TraceRequest(i * 0.5, blocks, 512, tokens, rng.randrange(20, 200)))
    return out


def test_the_analytic_model_batches_decode_and_scales_prefill_with_tokens() -> None:
    one = COST.step_seconds(StepShape(decode_rows=1, decode_context=4096, decode_context_swa=128, sampled_rows=1))
    many = COST.step_seconds(StepShape(decode_rows=32, decode_context=32 * 4096, decode_context_swa=32 * 128,
                                       sampled_rows=32))
    # Decode reads weights (and the experts its rows route to): batching 32 rows costs far less than 32 steps.
    assert one < many < 32 * one / 4
    short = COST.step_seconds(StepShape(1024, 1024 * 512, 1024 * 128, 0, sampled_rows=1))
    long = COST.step_seconds(StepShape(8192, 8192 * 4096, 8192 * 128, 0, sampled_rows=1))
    # A 1K chunk already reads every expert (memory-bound); an 8K one is compute-bound.
    assert 3 < long / short < 8
    assert COST.step_seconds(StepShape()) == 0.0


def test_a_linear_fit_recovers_its_coefficients() -> None:
    truth = LinearCost("truth", 0.002, (1e-5, 1e-9, 2e-4, 1e-8))
    shapes = [StepShape(p, p * c, 0, 0, d, d * c) for p in (0, 64, 512) for d in (0, 4, 16) for c in (100, 2000)
              if p or d]
    fit = LinearCost.fit([(s, truth.step_seconds(s)) for s in shapes])
    assert fit.intercept == pytest.approx(0.002, rel=1e-6)
    assert fit.coefficients == pytest.approx(truth.coefficients, rel=1e-6)


def test_the_load_is_calibrated_to_the_utilisation_asked_for() -> None:
    requests = _mixed()
    scale = calibrate_load(requests, COST, 0.7, ReplayConfig(policy="fcfs", full_tokens=1_000_000), rounds=3)
    measured = utilisation(replay(requests, COST, ReplayConfig(policy="fcfs", full_tokens=1_000_000), scale))
    assert measured == pytest.approx(0.7, abs=0.05)


def _burst() -> list[TraceRequest]:
    """Five 40K-token prompts, then forty 2K-token ones, all within a second."""
    out, block = [], 0
    for i in range(45):
        tokens = 40_960 if i < 5 else 2048
        blocks = tuple(("", block + k) for k in range(tokens // 512))
        block += len(blocks)
        out.append(TraceRequest(i * 0.02, blocks, 512, tokens, 50))
    return out


def test_compute_aware_serves_short_requests_before_long_ones_at_the_same_throughput() -> None:
    runs = {policy: replay(_burst(), COST, ReplayConfig(policy=policy, full_tokens=1_000_000)).times
            for policy in ("fcfs", "compute-aware", "lpm")}
    results = {policy: summarize(times) for policy, times in runs.items()}
    short = {policy: summarize([t for t in times if t.prompt_tokens < 16384]) for policy, times in runs.items()}
    fcfs, ours = results["fcfs"], results["compute-aware"]
    assert all(r["failed"] == 0 and r["requests"] == 45 for r in results.values())
    # FCFS: the short ones wait behind 200K tokens of long prefills; compute-aware serves them first.
    assert short["compute-aware"]["ttft_p90_s"] < 0.5 * short["fcfs"]["ttft_p90_s"]
    assert ours["ttft_p50_s"] < 0.5 * fcfs["ttft_p50_s"]
    assert ours["ttft_max_s"] < 3 * fcfs["ttft_max_s"]
    assert ours["throughput_tok_s"] >= 0.98 * fcfs["throughput_tok_s"]


def _trace_file(path: Path) -> Path:
    lines = [json.dumps({"timestamp": int(r.arrival * 1000), "input_length": r.input_tokens,
                         "output_length": r.output_tokens, "hash_ids": [h for _, h in r.blocks]})
             for r in _mixed(60)]
    path.write_text("\n".join(lines))
    return path


def test_the_bench_reports_every_policy_and_bucket(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    trace = _trace_file(tmp_path / "trace.jsonl")
    plot = tmp_path / "cdf.png"
    assert main(["bench", "schedule", "--trace", str(trace), "--load", "0.8", "--plot", str(plot), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"fcfs", "compute-aware", "lpm"}
    for policy in out["policies"].values():
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_max_s", "throughput_tok_s"):
            assert policy[key] > 0
        assert set(policy["buckets"]) <= {"0-64K", "64K-256K", "256K+"}
        assert policy["buckets"]["0-64K"]["requests"] == 60
    assert out["cost_model"]["name"] == "mimo-v2.5-pro-h200" and plot.stat().st_size > 0
    assert "compute_aware_vs_fcfs" in out


def test_a_closed_session_waits_for_its_answer_an_open_one_does_not() -> None:
    # Two turns of one session, the second sent 0.1 s after the first: far
    # sooner than the first's 200 output tokens take to decode.
    first = TraceRequest(0.0, tuple(("s", k) for k in range(8)), 512, 4096, 200, "s")
    second = TraceRequest(0.1, tuple(("s", k) for k in range(10)), 512, 5120, 20, "s")
    closed = replay([first, second], COST, ReplayConfig(full_tokens=1_000_000))
    opened = replay([first, second], COST, ReplayConfig(full_tokens=1_000_000, closed_sessions=False))
    assert closed.times[1].arrival >= closed.times[0].finished  # type: ignore[operator]
    assert opened.times[1].arrival == pytest.approx(0.1)
    assert opened.times[1].first_token < opened.times[0].finished  # type: ignore[operator]
