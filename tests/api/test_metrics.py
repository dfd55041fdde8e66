"""ServerMetrics as Prometheus scrapes it: parsed back from render()."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from the exposition text."""
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, tuple(sorted(labels.items()))))


ENGINE_STATS = {
    "prefix_cache": {
        "cached_prompt_tokens": 300, "computed_prompt_tokens": 700, "hit_rate": 0.3, "nodes": 5, "swa_slots_cached": 2,
    },
    "swa_mode": "ring",
    "full_pool": {"capacity_tokens": 1000, "free_tokens": 250, "bytes_per_token": 64},
    "swa_pool": {"capacity_tokens": 400, "free_tokens": 400, "bytes_per_token": 32},
    "running_requests": 3,
    "waiting_requests": 7,
    "preemptions": 11,
}


def test_content_type_and_render_is_prometheus_text() -> None:
    metrics = ServerMetrics()
    assert metrics.content_type.startswith("text/plain") and "version=" in metrics.content_type
    assert isinstance(metrics.render(), bytes)
    assert b"# TYPE swallow_requests_total counter" in metrics.render()


def test_observe_request_counts_errors_separately() -> None:
    metrics = ServerMetrics()
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/chat/completions", 413)
    metrics.observe_request("/v1/files", 500)

    assert value(metrics, "swallow_requests_total", endpoint="/v1/chat/completions", status="200") == 2
    assert value(metrics, "swallow_requests_total", endpoint="/v1/chat/completions", status="413") == 1
    assert value(metrics, "swallow_requests_total", endpoint="/v1/files", status="500") == 1
    assert value(metrics, "swallow_request_errors_total", endpoint="/v1/chat/completions", status="413") == 1
    assert value(metrics, "swallow_request_errors_total", endpoint="/v1/files", status="500") == 1
    assert value(metrics, "swallow_request_errors_total", endpoint="/v1/chat/completions", status="200") is None


@pytest.mark.parametrize(
    ("observe", "name", "low", "high"),
    [
        ("observe_ttft", "swallow_time_to_first_token_seconds", 0.001, 60.0),
        ("observe_inter_token", "swallow_inter_token_latency_seconds", 0.0005, 10.0),
    ],
)
def test_latency_histograms(observe: str, name: str, low: float, high: float) -> None:
    metrics = ServerMetrics()
    for seconds in (low / 2, 0.02, high * 2):
        getattr(metrics, observe)(seconds)

    assert value(metrics, f"{name}_count") == 3
    assert math.isclose(value(metrics, f"{name}_sum"), low / 2 + 0.02 + high * 2)
    buckets = {float(le): v for (n, labels), v in samples(metrics).items() if n == f"{name}_bucket" for _, le in labels}
    assert min(buckets) == low and max(b for b in buckets if b != math.inf) == high
    assert buckets[low] == 1  # only low / 2
    assert buckets[high] == 2  # high * 2 overflows into +Inf
    assert buckets[math.inf] == 3


def test_queue_depth_gauges() -> None:
    metrics = ServerMetrics()
    metrics.set_queue_depth(waiting=4, running=2)
    assert value(metrics, "swallow_requests_waiting") == 4
    assert value(metrics, "swallow_requests_running") == 2
    metrics.set_queue_depth(waiting=0, running=1)
    assert value(metrics, "swallow_requests_waiting") == 0


def test_engine_stats() -> None:
    metrics = ServerMetrics()
    metrics.set_engine_stats(ENGINE_STATS)

    assert value(metrics, "swallow_kv_pool_capacity_tokens", pool="full") == 1000
    assert value(metrics, "swallow_kv_pool_used_tokens", pool="full") == 750
    assert value(metrics, "swallow_kv_pool_usage_ratio", pool="full") == 0.75
    assert value(metrics, "swallow_kv_pool_capacity_tokens", pool="swa") == 400
    assert value(metrics, "swallow_kv_pool_used_tokens", pool="swa") == 0
    assert value(metrics, "swallow_kv_pool_usage_ratio", pool="swa") == 0
    assert value(metrics, "swallow_prefix_cache_hit_rate") == 0.3
    assert value(metrics, "swallow_prefix_cache_cached_tokens") == 300
    assert value(metrics, "swallow_preemptions") == 11
    assert value(metrics, "swallow_requests_waiting") == 7
    assert value(metrics, "swallow_requests_running") == 3


def test_engine_stats_without_prefix_cache_and_with_empty_pool() -> None:
    metrics = ServerMetrics()
    stats = ENGINE_STATS | {"prefix_cache": None, "swa_pool": {"capacity_tokens": 0, "free_tokens": 0}}
    metrics.set_engine_stats(stats)
    assert value(metrics, "swallow_kv_pool_usage_ratio", pool="swa") == 0
    assert value(metrics, "swallow_prefix_cache_hit_rate") == 0
    # The preemption gauge follows the engine's total, it does not accumulate.
    metrics.set_engine_stats(stats | {"preemptions": 12})
    assert value(metrics, "swallow_preemptions") == 12


def test_speculative_decoding_per_draft_position() -> None:
    metrics = ServerMetrics()
    spec = {"num_speculative_tokens": 3, "verify_steps": 10, "drafts_proposed": [10, 9, 9],
            "drafts_accepted": [8, 5, 2], "acceptance_rate_per_position": [0.8, 0.56, 0.22],
            "mean_acceptance_length": 2.5}
    metrics.set_engine_stats(ENGINE_STATS | {"speculative": spec})
    assert value(metrics, "swallow_spec_drafts_proposed", position="2") == 9
    assert value(metrics, "swallow_spec_drafts_accepted", position="3") == 2
    assert value(metrics, "swallow_spec_mean_acceptance_length") == 2.5


def test_engine_stats_from_a_real_engine(tiny_checkpoint) -> None:
    from llm_core import LLM

    metrics = ServerMetrics()
    metrics.set_engine_stats(LLM(tiny_checkpoint).stats())
    capacity = value(metrics, "swallow_kv_pool_capacity_tokens", pool="full")
    assert capacity and capacity > 0
    assert value(metrics, "swallow_kv_pool_used_tokens", pool="full") == 0


def test_encoder_batch_histogram() -> None:
    metrics = ServerMetrics()
    for items in (1, 3, 300):
        metrics.observe_encoder_batch("vision", items)
    metrics.observe_encoder_batch("audio", 8)

    assert value(metrics, "swallow_encoder_batch_size_count", encoder="vision") == 3
    assert value(metrics, "swallow_encoder_batch_size_sum", encoder="vision") == 304
    assert value(metrics, "swallow_encoder_batch_size_bucket", encoder="vision", le="1.0") == 1
    assert value(metrics, "swallow_encoder_batch_size_bucket", encoder="vision", le="4.0") == 2
    assert value(metrics, "swallow_encoder_batch_size_bucket", encoder="vision", le="256.0") == 2
    assert value(metrics, "swallow_encoder_batch_size_bucket", encoder="vision", le="+Inf") == 3
    assert value(metrics, "swallow_encoder_batch_size_count", encoder="audio") == 1


def test_embedding_cache_hits_and_misses() -> None:
    metrics = ServerMetrics()
    metrics.count_embedding("image", cached=True)
    metrics.count_embedding("image", cached=True)
    metrics.count_embedding("image", cached=False)
    metrics.count_embedding("video", cached=False)

    assert value(metrics, "swallow_embedding_cache_requests_total", kind="image", result="hit") == 2
    assert value(metrics, "swallow_embedding_cache_requests_total", kind="image", result="miss") == 1
    assert value(metrics, "swallow_embedding_cache_requests_total", kind="video", result="miss") == 1
    assert value(metrics, "swallow_embedding_cache_requests_total", kind="video", result="hit") is None


def test_token_counters() -> None:
    metrics = ServerMetrics()
    metrics.count_tokens(prompt=120, completion=30)
    metrics.count_tokens(prompt=5, completion=0)
    assert value(metrics, "swallow_prompt_tokens_total") == 125
    assert value(metrics, "swallow_generation_tokens_total") == 30


def test_instances_do_not_share_state() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.observe_request("/health", 200)
    first.count_tokens(prompt=10, completion=2)
    first.set_engine_stats(ENGINE_STATS)

    assert value(first, "swallow_requests_total", endpoint="/health", status="200") == 1
    assert value(second, "swallow_requests_total", endpoint="/health", status="200") is None
    assert value(second, "swallow_prompt_tokens_total") == 0
    assert value(second, "swallow_kv_pool_capacity_tokens", pool="full") is None
    assert first.registry is not second.registry


def test_kv_tier_stats_are_mirrored_with_a_restore_latency_histogram() -> None:
    metrics = ServerMetrics()
    stats = {
        **ENGINE_STATS,
        "prefix_cache": {**ENGINE_STATS["prefix_cache"],
                         "cached_tokens_by_tier": {"device": 100, "host": 150, "disk": 50}},
        "kv_tiers": {
            "host_bytes_used": 10, "host_bytes_capacity": 100, "disk_bytes_used": 20, "disk_bytes_capacity": 200,
            "demoted_bytes": 30, "spilled_bytes": 5, "restored_bytes": {"host": 7, "disk": 3},
            "checksum_failures": 2, "load_failures": 1,
            "restore_seconds_buckets": [0.001, 0.01], "restore_seconds_counts": [4, 1, 2], "restore_seconds_sum": 0.5,
        },
    }
    metrics.set_engine_stats(stats)
    assert value(metrics, "swallow_prefix_cache_cached_tokens_by_tier", tier="host") == 150
    assert value(metrics, "swallow_kv_tier_used_bytes", tier="disk") == 20
    assert value(metrics, "swallow_kv_tier_capacity_bytes", tier="host") == 100
    assert value(metrics, "swallow_kv_tier_bytes", direction="restored", tier="disk") == 3
    assert value(metrics, "swallow_kv_tier_bytes", direction="demoted", tier="host") == 30
    assert value(metrics, "swallow_kv_tier_checksum_failures") == 2
    assert value(metrics, "swallow_kv_restore_seconds_bucket", le="0.001") == 4
    assert value(metrics, "swallow_kv_restore_seconds_bucket", le="0.01") == 5
    assert value(metrics, "swallow_kv_restore_seconds_bucket", le="+Inf") == 7
    assert value(metrics, "swallow_kv_restore_seconds_count") == 7
    assert value(metrics, "swallow_kv_restore_seconds_sum") == 0.5


def test_queue_wait_and_ttft_per_length_bucket_are_histograms() -> None:
    metrics = ServerMetrics()
    bucket = {"queue_wait": {"counts": [2, 1, 0], "sum_s": 0.4}, "ttft": {"counts": [0, 3, 1], "sum_s": 2.5}}
    long = {"queue_wait": {"counts": [0, 0, 1], "sum_s": 9.0}, "ttft": {"counts": [0, 0, 1], "sum_s": 12.0}}
    metrics.set_engine_stats({**ENGINE_STATS, "schedule": {
        "policy": "compute-aware", "bucket_edges": [65536], "latency_buckets_s": [0.1, 1.0],
        "buckets": {"0-64K": bucket, "64K+": long}}})
    assert value(metrics, "swallow_queue_wait_seconds_bucket", bucket="0-64K", le="0.1") == 2
    assert value(metrics, "swallow_queue_wait_seconds_bucket", bucket="0-64K", le="+Inf") == 3
    assert value(metrics, "swallow_queue_wait_seconds_sum", bucket="64K+") == 9.0
    assert value(metrics, "swallow_bucket_ttft_seconds_bucket", bucket="0-64K", le="1.0") == 3
    assert value(metrics, "swallow_bucket_ttft_seconds_count", bucket="64K+") == 1


def test_summary_reads_what_swa_saves_from_the_registry() -> None:
    metrics = ServerMetrics()
    stats = {**ENGINE_STATS, "swa_pool": {"capacity_tokens": 400, "free_tokens": 300, "bytes_per_token": 32}}
    metrics.set_engine_stats(stats)
    metrics.observe_encoder_batch("vision", 3)
    metrics.observe_encoder_batch("vision", 1)
    metrics.count_embedding("video", cached=True)
    metrics.count_embedding("image", cached=True)
    metrics.count_embedding("audio", cached=False)
    summary = metrics.summary()
    # 750 full tokens at 64 B, 100 SWA slots at 32 B; full attention: 750 tokens at 64 + 32 B.
    assert value(metrics, "swallow_kv_pool_used_bytes", pool="full") == 750 * 64
    assert value(metrics, "swallow_kv_full_attention_equivalent_bytes") == 750 * 96
    assert summary["kv_bytes_in_use"] == 750 * 64 + 100 * 32
    assert summary["kv_bytes_full_attention"] == 750 * 96
    assert summary["kv_saving_ratio"] == round(750 * 96 / (750 * 64 + 100 * 32), 3)
    # The pools' memory (1000 * 64 + 400 * 32 B) as full-attention tokens of 96 B each.
    assert summary["kv_capacity_tokens"] == 1000
    assert summary["kv_capacity_tokens_full_attention"] == (1000 * 64 + 400 * 32) // 96
    assert summary["full_pool_tokens_used"] == 750 and summary["swa_slots_used"] == 100
    assert summary["prefix_cache_hit_rate"] == 0.3 and summary["prefix_cache_cached_tokens"] == 300
    assert summary["embedding_cache_hits"] == 2 and summary["embedding_cache_misses"] == 1
    assert summary["encoder_batches"]["vision"] == {"batches": 2, "items": 4, "mean_batch_size": 2.0}
    assert summary["encoder_batches"]["audio"] == {"batches": 0, "items": 0, "mean_batch_size": 0.0}
    assert summary["requests_running"] == 3 and summary["requests_waiting"] == 7


def test_summary_of_a_fresh_server_has_no_ratios() -> None:
    summary = ServerMetrics().summary()
    assert summary["kv_saving_ratio"] is None and summary["kv_capacity_gain"] is None
    assert summary["kv_bytes_in_use"] == 0
