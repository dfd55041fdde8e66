"""`swallow bench serve`: served against offline on the same engine options, a
real `swallow serve` subprocess, greedy outputs identical to the offline ones."""

from __future__ import annotations

import math

import pytest

from bench.registry import bench_parser
from bench.serve import parse_levels, serve_bench
from bench.serve_drivers import Stream
from bench.serve_servers import recompiles_in, split_server_args

LEVEL_KEYS = {"tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "offline_tok_s",
              "served_over_offline"}
TOP_KEYS = {"levels", "served_over_offline", "ready_s_cold", "ready_s_warm", "recompiles_after_ready",
            "identical_greedy", "speculative_tokens", "compile", "server_args", "torch_threads", "model", "vllm",
            "notes"}


def test_itl_is_per_token_and_its_mean_is_the_per_token_time() -> None:
    stream = Stream(sent_s=0.0)
    stream.receive([7], 1.0)  # TTFT 1 s
    stream.receive([8, 9], 1.4)  # two tokens in one chunk: 0.2 s each
    stream.receive([], 1.5)  # a chunk without tokens changes nothing
    stream.receive([10], 1.5)
    assert stream.ttft_s == 1.0 and stream.token_ids == [7, 8, 9, 10]
    assert [round(gap, 6) for gap in stream.itl_s] == [0.2, 0.2, 0.1]
    assert math.isclose(stream.per_token_s, sum(stream.itl_s) / 3)


def test_a_level_takes_its_fastest_runs_throughput_and_every_runs_latencies() -> None:
    from bench.serve import summarize
    from bench.serve_drivers import Run

    def run(wall_s: float, ttfts: list[float]) -> Run:
        streams = []
        for ttft in ttfts:
            stream = Stream(sent_s=0.0)
            stream.receive([1], ttft)
            stream.receive([2], ttft + 0.01)
            streams.append(stream)
        return Run(wall_s, streams)

    slow, fast = run(4.0, [0.5, 0.6]), run(2.0, [0.1, 0.2])
    figures = summarize([slow, fast])
    assert figures["tok_s"] == 2.0 and figures["wall_s"] == 2.0 and figures["output_tokens"] == 4
    assert figures["ttft_p50_ms"] == 350.0  # the median of 0.1, 0.2, 0.5 and 0.6 s, not the fast run's 150 ms
    assert summarize([fast])["ttft_p50_ms"] == 150.0


def test_recompile_counter_is_read_summed_or_reported_missing() -> None:
    text = ('# TYPE swallow_recompiles counter\nswallow_recompiles_total{graph="decode"} 2.0\n'
            'swallow_recompiles_total{graph="extend"} 1.0\n')
    assert recompiles_in(text) == 3.0
    assert recompiles_in("# TYPE swallow_requests counter\nswallow_requests_total 4.0\n") is None


def test_cli_flags() -> None:
    args = bench_parser("serve").parse_args(["--concurrency", "8,1", "--no-compile",
                                             "--server-arg=--kv-budget-mib 128", "--peer-vllm", "/x/python"])
    assert parse_levels(args.concurrency) == (1, 8) and parse_levels(None) == (1, 8, 32)
    assert args.compile is False and args.peer_vllm == "/x/python"
    assert split_server_args(args.server_arg) == ["--kv-budget-mib", "128"]
    with pytest.raises(ValueError):
        parse_levels("0,4")


def test_bench_serve_against_a_live_server() -> None:
    result = serve_bench((1, 2), num_requests=4, repeats=1, compile=False, speculative_tokens=0,
                         max_output_tokens=8, log=lambda _: None)
    assert TOP_KEYS <= set(result)
    assert result["identical_greedy"] is True and result["offline_identical_across_levels"] is True
    assert result["compile"] is False and result["speculative_tokens"] == 0 and result["vllm"] is None
    assert "--no-compile" in result["server_args"]
    assert result["ready_s_cold"] > 0 and result["ready_s_warm"] > 0 and result["torch_threads"] >= 1
    assert set(result["levels"]) == set(result["served_over_offline"]) == {"1", "2"}
    for figures in result["levels"].values():
        assert LEVEL_KEYS <= set(figures)
        assert all(figures[key] > 0 for key in LEVEL_KEYS)
        assert figures["output_tokens"] == 4 * 8
    one = result["levels"]["1"]
    assert one["offline_per_token_ms"] > 0 and one["itl_over_offline_per_token"] > 0
    # Missing counter (a server without it): null and a note saying why, never a made-up 0.
    if result["recompiles_after_ready"] is None:
        assert any("swallow_recompiles_total" in note for note in result["notes"])
    else:
        assert result["recompiles_after_ready"] >= 0


def test_drivers_take_turns_run_by_run() -> None:
    """Every side warms up untimed, then each level's runs alternate between
    the sides, so a slow minute of the machine falls on all of them alike."""
    from bench.serve_drivers import Plan, Run, Workload, interleaved_levels

    calls: list[tuple[str, int, int]] = []

    def driver(name: str):  # noqa: ANN202
        def drive(workload: Workload, concurrency: int) -> Run:
            calls.append((name, len(workload.prompts), concurrency))
            return Run(1.0, [])
        return drive

    workload = Workload([[1, 2, 3]] * 4, [2] * 4)
    runs = interleaved_levels({"a": driver("a"), "b": driver("b")}, Plan(workload, (1, 4), 2, lambda _: None))
    assert calls[:4] == [("a", 4, 1), ("a", 4, 4), ("b", 4, 1), ("b", 4, 4)]  # warm-ups: 4 short requests
    assert [(name, c) for name, _, c in calls[4:]] == [("a", 1), ("b", 1)] * 2 + [("a", 4), ("b", 4)] * 2
    assert {name: {c: len(r) for c, r in by.items()} for name, by in runs.items()} == {"a": {1: 2, 4: 2},
                                                                                      "b": {1: 2, 4: 2}}


def test_a_failing_peer_is_reported_and_stops_running() -> None:
    from bench.serve import _reporting_failure, _vllm_section
    from bench.serve_drivers import Run, Workload

    attempts = []

    def broken(workload: Workload, concurrency: int) -> Run:
        attempts.append(concurrency)
        raise RuntimeError("the stream carried an error")

    about: dict = {"version": "x"}
    drive = _reporting_failure(broken, about)
    workload = Workload([[1]], [1])
    assert drive(workload, 1).streams == [] and drive(workload, 8).streams == []
    assert attempts == [1]
    notes: list[str] = []
    section = _vllm_section(about, {}, {}, [], notes)
    assert "the stream carried an error" in section["error"] and notes
