"""`swallow bench encoder` runs end to end and reports what it measured."""

from __future__ import annotations

import json

from swallow.cli import main


def test_bench_encoder_prints_one_json_object(capsys) -> None:  # noqa: ANN001 - pytest fixture
    argv = ["bench", "encoder", "--concurrency", "4", "--encoder-requests", "16", "--repeats", "1", "--json"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    tp = result["throughput"]
    assert tp["requests"] == 16 and tp["batched_items_per_s"] > 0 and tp["one_at_a_time_items_per_s"] > 0
    # Batched outputs are the one-by-one outputs.
    assert tp["max_abs_diff_batched_vs_single"] <= 1e-5
    assert tp["baseline_batches"]["vision"]["mean_batch"] == 1.0
    assert [row["image_px"] for row in tp["by_image_size"]] == [56, 112, 224]
    cache = result["cache"]
    assert cache["embed_image_hit"]["embedding_bytes"] == 1 << 20
    assert cache["store_get"]["p50_ms"] < 2.0
