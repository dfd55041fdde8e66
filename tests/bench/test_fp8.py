"""`swallow bench fp8`'s parts that fit a test's time (the whole bench runs in
about a minute: docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench.fp8 import kv_capacity_ratio, load_peak
from llm_core.model.presets import tiny


def test_an_fp8_kv_cache_fits_twice_the_requests() -> None:
    result = kv_capacity_ratio()
    assert result["kv_capacity_fp8_over_bf16"] >= 1.95
    assert result["kv_requests_fp8"] > result["kv_requests_bf16"] > 0


def test_loading_holds_the_model_and_little_more(tmp_path: Path) -> None:
    # A small checkpoint (the bench loads a 0.9 GB one).
    config = dataclasses.replace(tiny(), vocab_size=8192, hidden_size=512, moe_intermediate_size=256,
                                 n_routed_experts=16)
    result = load_peak(tmp_path, lambda _: None, config)
    assert result["load_resident_bytes"] > result["load_checkpoint_file_bytes"]  # bfloat16 from FP8
    assert 0.9 <= result["load_peak_rss_over_resident"] < 1.3, result
