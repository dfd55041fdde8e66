"""``swallow bench tiers`` on short prefixes: every figure is measured and
consistent (the long sweep belongs to the bench, not the suite)."""

from __future__ import annotations

import json

from bench.tiers import tiers_bench
from swallow.cli import main


def test_tiers_bench_reports_bandwidth_ratios_and_ttft_per_length() -> None:
    result = tiers_bench(lengths=(128, 256), repeats=1)
    for key in ("host_restore_vs_memcpy", "disk_restore_vs_read", "host_restore_gbps", "disk_restore_gbps"):
        assert result[key] > 0
    assert result["restored_pages"] == 256 // result["page_size"]
    for key in ("ttft_restore_host_s", "ttft_restore_disk_s", "ttft_recompute_s"):
        assert set(result[key]) == {128, 256} and all(v > 0 for v in result[key].values())
    for tier, length in result["crossover_tokens"].items():
        restored = result[f"ttft_restore_{tier}_s"]
        faster = [n for n in (128, 256) if restored[n] < result["ttft_recompute_s"][n]]
        assert length == (faster[0] if faster else None)


def test_bench_tiers_command_prints_one_json_object(capsys) -> None:
    assert main(["bench", "tiers", "--lengths", "128", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ttft_recompute_s"]["128"] > 0
