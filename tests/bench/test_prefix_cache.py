from __future__ import annotations

import json
from pathlib import Path

import pytest

from swallow.cli import main
from bench.prefix_cache import (
    load_trace,
    plot_sweep,
    plot_tier_sweep,
    prefix_cache_bench,
    sweep,
    tier_sweep,
    upper_bound,
)

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "traces"


def _session(path: Path, name: str, turns: int, base: int, gap_s: float = 10.0) -> None:
    """An agent session: each request extends the previous context by a few blocks."""
    requests, ids = [], []
    for t in range(turns):
        ids = ids + [base + len(ids) + k for k in range(3)]
        requests.append({"t": gap_s * t, "type": "n", "in": 64 * len(ids) + 20, "out": 100, "hash_ids": ids})
    (path / f"{name}.json").write_text(json.dumps(
        {"id": name, "block_size": 64, "hash_id_scope": "local", "requests": requests}))


@pytest.fixture
def agentic_dir(tmp_path: Path) -> Path:
    for k in range(3):
        _session(tmp_path, f"trace_{k:04d}", turns=6, base=1)  # same ids, local scope: no sharing across files
    return tmp_path


def test_sessions_interleave_and_local_ids_stay_local(agentic_dir: Path) -> None:
    requests = load_trace(agentic_dir, stagger_s=5.0)
    assert len(requests) == 18
    assert [r.arrival for r in requests] == sorted(r.arrival for r in requests)
    assert len({r.blocks[0] for r in requests}) == 3  # one scope per session file


def test_window_policy_reaches_the_upper_bound_on_agent_sessions(agentic_dir: Path) -> None:
    result = prefix_cache_bench(agentic_dir, full_tokens=64 * 400, swa_fraction=0.05)
    bound = upper_bound(load_trace(agentic_dir))
    assert result["upper_bound"] == round(bound, 4) > 0.5
    assert result["false_hits"] == 0 and result["hits_verified"] > 0
    assert result["hit_rate"] >= result["upper_bound"] - 0.01
    baselines = result["baselines"]
    assert baselines["keep_all_swa_full_size_pool"]["hit_rate"] <= result["upper_bound"] + 1e-9
    assert baselines["tombstones_no_checkpoints_no_fallback"]["hit_rate"] < result["hit_rate"]


def test_sweep_and_plot(agentic_dir: Path, tmp_path: Path) -> None:
    points = list(sweep(agentic_dir, [0.01, 0.1], full_tokens=64 * 400))
    assert {(p["swa_fraction"], p["policy"]) for p in points} == {
        (f, pol) for f in (0.01, 0.1) for pol in ("window", "keep_all", "no_checkpoints")}
    out = tmp_path / "plot.png"
    plot_sweep(points, 0.9, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not (SHARED / "agentic").is_dir(), reason="shared traces not beside the checkout")
def test_bench_command_on_the_real_agentic_trace(capsys) -> None:
    assert main(["bench", "prefix-cache", "--trace", str(SHARED / "agentic"), "--limit", "25", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests"] == 25 and result["false_hits"] == 0
    assert result["hit_rate"] >= result["upper_bound"] - 0.01


@pytest.mark.skipif(not (SHARED / "mooncake").is_dir(), reason="shared traces not beside the checkout")
def test_mooncake_trace_loads_with_512_token_blocks() -> None:
    requests = load_trace(SHARED / "mooncake" / "conversation_trace.jsonl")
    assert len(requests) == 12031 and requests[0].block_size == 512
    assert all(len(r.blocks) == r.input_tokens // 512 for r in requests[:200])


@pytest.fixture
def interleaved_dir(tmp_path: Path) -> Path:
    """Six sessions whose turns interleave (a turn every 100 s, sessions 60 s apart)."""
    (tmp_path / "sessions").mkdir()
    for k in range(6):
        _session(tmp_path / "sessions", f"trace_{k:04d}", turns=6, base=1, gap_s=100.0)
    return tmp_path / "sessions"


def test_host_tier_brings_back_sessions_a_small_device_pool_forgot(interleaved_dir: Path, tmp_path: Path) -> None:
    # A device pool of 24 blocks holds barely one session's context: turns come back from the host tier.
    agentic_dir = interleaved_dir
    small = prefix_cache_bench(agentic_dir, full_tokens=64 * 24, swa_fraction=0.5)
    tiered = prefix_cache_bench(agentic_dir, full_tokens=64 * 24, swa_fraction=0.5, host_tokens=64 * 2000)
    assert tiered["hit_rate_device_only"] == small["hit_rate"] < tiered["upper_bound"] - 0.1
    assert tiered["hit_rate"] >= tiered["upper_bound"] - 0.01
    assert tiered["hit_rate_by_tier"]["host"] > 0 and tiered["false_hits"] == 0
    assert sum(tiered["hit_rate_by_tier"].values()) == pytest.approx(tiered["hit_rate"], abs=2e-4)
    points = list(tier_sweep(agentic_dir, [0, 64 * 40, 64 * 2000], full_tokens=64 * 24, swa_fraction=0.5))
    rates = [p["hit_rate"] for p in points]
    assert rates == sorted(rates) and rates[0] == small["hit_rate"]
    out = tmp_path / "tiers.png"
    plot_tier_sweep(points, tiered["upper_bound"], 64 * 24, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
