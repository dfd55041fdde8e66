from __future__ import annotations

from bench.step import step_bench


def test_step_bench_reports_setup_per_context() -> None:
    result = step_bench(contexts=(256, 2048), running=8, steps=4, preset="tiny")
    for key in ("setup_ms_256", "setup_ms_2k", "baseline_setup_ms_256", "baseline_setup_ms_2k",
                "ratio_2k_256", "baseline_ratio_2k_256"):
        assert result[key] > 0, key
    # The baseline adds the old per-step slot lists to the same steps: never cheaper.
    assert result["baseline_setup_ms_2k"] >= result["setup_ms_2k"]
