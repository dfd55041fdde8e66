"""The router bench: N replay workers behind the real router, on a small
trace of agent sessions built so that only affinity keeps them cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swallow.cli import main
from bench.prefix_cache import load_trace
from bench.router import NodeMemory, replay_routed, router_bench
from bench.replay_cost import AnalyticCost
from bench.schedule_replay import ReplayConfig, replay
from llm_core.model.presets import get_preset
from llm_core.cluster.router import Router

PAGE = 64


def _sessions(path: Path, sessions: int = 8, turns: int = 8, growth_blocks: int = 12) -> Path:
    """Agent sessions whose every request extends the previous context: a
    worker that served a session's last turn holds all but the new blocks."""
    for k in range(sessions):
        requests, ids = [], []
        for t in range(turns):
            ids = ids + [len(ids) + j for j in range(growth_blocks)]
            requests.append({"t": 2.0 * t, "type": "n", "in": PAGE * len(ids) + 10, "out": 24, "hash_ids": ids})
        (path / f"trace_{k:04d}.json").write_text(json.dumps(
            {"id": k, "block_size": PAGE, "hash_id_scope": "local", "requests": requests}))
    return path


# Each worker holds about two sessions' contexts (6K tokens at their longest):
# spread over four workers round-robin, every worker sees all eight.
MEMORY = {"full_tokens": 16_384, "swa_fraction": 0.75}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    trace = _sessions(tmp_path_factory.mktemp("sessions"))
    return router_bench(str(trace), workers=4, stagger_s=1.0, **MEMORY)  # type: ignore[arg-type]


def test_the_report_has_every_policy_and_the_bound(result: dict) -> None:
    assert set(result["policies"]) == {"kv-affinity", "round-robin", "least-load"}
    for summary in result["policies"].values():
        assert 0 <= summary["hit_rate"] <= 1
        assert summary["load_max_over_mean"] >= 1
        assert summary["ttft_p90_s"] > 0 and summary["failed"] == 0
        assert len(summary["workers"]) == 4
        assert sum(w["requests"] for w in summary["workers"]) == result["requests"] == 64
    assert 0 < result["one_big_cache"]["hit_rate"] <= result["upper_bound"] + 1e-9
    assert result["memory_per_worker"]["full_tokens"] == MEMORY["full_tokens"]
    assert result["one_big_cache"]["full_tokens"] == 4 * MEMORY["full_tokens"]
    json.dumps(result)  # JSON-ready


def test_affinity_keeps_sessions_cached_where_round_robin_cannot(result: dict) -> None:
    ours, rr = result["policies"]["kv-affinity"], result["policies"]["round-robin"]
    assert ours["hit_rate"] >= 1.25 * rr["hit_rate"]
    assert result["kv_affinity_vs_round_robin"] == pytest.approx(ours["hit_rate"] / rr["hit_rate"], abs=1e-3)
    assert result["gap_to_one_big_cache"] <= 0.02
    # What the router expected from its index is what the workers' caches served.
    assert ours["routed_expected_hit_rate"] == pytest.approx(ours["hit_rate"], abs=0.02)
    assert ours["decisions"].get("affinity", 0) > ours["decisions"].get("miss", 0)
    assert ours["load_max_over_mean"] <= 1.5


def test_one_routed_worker_replays_exactly_as_the_schedule_bench(tmp_path: Path) -> None:
    requests = load_trace(_sessions(tmp_path, sessions=3, turns=4), stagger_s=1.0)
    cost = AnalyticCost.for_preset(get_preset("mimo-v2.5-pro"))
    config = ReplayConfig(full_tokens=MEMORY["full_tokens"], swa_fraction=MEMORY["swa_fraction"])
    alone = replay(requests, cost, config, 0.05)
    routed, dispatch = replay_routed(requests, cost, config, 1, Router(), 0.05)
    assert routed.times == alone.times and routed.steps == alone.steps and routed.cached_tokens > 0
    assert dispatch.expected_cached_tokens == routed.cached_tokens  # the index saw what the cache served


def test_the_node_leaves_little_room_for_kv_next_to_a_trillion_parameters() -> None:
    config, node = get_preset("mimo-v2.5-pro"), NodeMemory()
    full, swa = node.bytes_per_token(config)
    assert (full, swa) == (51_200, 322_560)  # 10 full layers; 60 SWA + 3 MTP layers, 8 KV heads of 192 + 128
    tokens = node.full_tokens(config, 0.05)
    assert 0.5e6 < tokens < 1.5e6
    assert tokens * (full + 0.05 * swa) <= node.kv_bytes(config) < (tokens + 1) * (full + 0.05 * swa)


def test_the_cli_prints_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.router as bench

    calls = {}

    def fake(trace: str, **kwargs: object) -> dict:
        calls.update(kwargs, trace=trace)
        return {"policies": {}}

    monkeypatch.setattr(bench, "router_bench", fake)
    assert main(["bench", "router", "--trace", "t", "--workers", "3", "--load", "0.7", "--limit", "9",
                 "--stagger-s", "5", "--route-max-load-ratio", "1.5", "--worker-full-tokens", "1000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"policies": {}}
    assert calls["trace"] == "t" and calls["workers"] == 3 and calls["load"] == 0.7 and calls["limit"] == 9
    assert calls["stagger_s"] == 5.0 and calls["max_load_ratio"] == 1.5 and calls["full_tokens"] == 1000
    assert calls["load_weight"] is None  # the router's default


def test_the_cli_sweeps_memory_per_worker_and_plots_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "trace").mkdir()
    trace = _sessions(tmp_path / "trace", sessions=4, turns=3)
    plot = tmp_path / "sweep.png"
    assert main(["bench", "router", "--trace", str(trace), "--workers", "2", "--stagger-s", "1",
                 "--memory-sweep", "8192,32768", "--plot", str(plot), "--json"]) == 0
    sweep = json.loads(capsys.readouterr().out)["sweep"]
    assert [r["memory_per_worker"]["full_tokens"] for r in sweep] == [8192, 32768]
    assert sweep[0]["one_big_cache"]["hit_rate"] <= sweep[1]["one_big_cache"]["hit_rate"]
    assert plot.stat().st_size > 0
