from __future__ import annotations

from bench.throughput import make_workload, throughput


def test_workload_shape() -> None:
    prompts, outputs = make_workload(32, 512, seed=0)
    assert len(prompts) == len(outputs) == 32
    assert all(16 <= len(p) <= 512 for p in prompts) and all(16 <= n <= 256 for n in outputs)
    assert make_workload(32, 512, seed=0) == (prompts, outputs)


def test_throughput_benchmark_runs_both_sides() -> None:
    result = throughput(seed=1, num_requests=3, repeats=1, compile=False)
    assert result["swallow_tokens_per_s"] > 0 and result["transformers_tokens_per_s"] > 0
    assert abs(result["ratio"] - result["transformers_seconds"] / result["swallow_seconds"]) < 0.01 * result["ratio"]
    assert result["output_tokens"] == sum(make_workload(3, 512, seed=1)[1])
    assert result["compiled_matches_eager"] and result["compile"] is False
