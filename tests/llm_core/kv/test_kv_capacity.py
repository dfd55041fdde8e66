from __future__ import annotations

import json

import pytest

from swallow.cli import main
from llm_core.kv.kv_capacity import GIB, kv_capacity
from llm_core.model.presets import get_preset


@pytest.mark.parametrize("preset", ["mimo-v2.5-pro", "mimo-v2-flash"])
def test_hybrid_pools_reach_the_theoretical_gain(preset: str) -> None:
    # A smaller budget than the benchmark's keeps this fast; the baseline still admits > 100.
    result = kv_capacity(get_preset(preset), 32768, 2048 * GIB)
    assert result["full_max_requests"] >= 100
    assert result["gain"] >= 0.98 * result["theoretical_gain"]
    # The gain is the SWA saving: about 7x for V2.5-Pro, about 10x for V2-Flash.
    assert result["theoretical_gain"] > 6


def test_full_mode_gains_nothing_and_hybrid_needs_its_windows() -> None:
    config = get_preset("mimo-v2-flash")
    result = kv_capacity(config, 4096, 512 * GIB)
    hybrid, full = result["pools"]["hybrid"], result["pools"]["full"]
    assert full["swa_pool_tokens"] == full["full_pool_tokens"]
    assert hybrid["swa_pool_tokens"] < hybrid["full_pool_tokens"] / 10
    assert hybrid["pool_bytes"] <= 512 * GIB and full["pool_bytes"] <= 512 * GIB


def test_bench_kv_command_prints_one_json_object(capsys) -> None:
    assert main(["bench", "kv", "--preset", "mimo-v2.5-pro", "--context", "8192", "--kv-budget-gib", "256",
                 "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    result = json.loads(out[0])
    assert {"hybrid_max_requests", "full_max_requests", "gain", "theoretical_gain"} <= result.keys()
