"""Prometheus metrics of one server instance.

Every ServerMetrics owns a private CollectorRegistry: several apps may live in
one process (tests do this), and the global registry would make them share
counters or fail on duplicate names.
"""

from __future__ import annotations

from typing import Any

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

# From a cached 1-token prompt (~1 ms) to a long video prompt behind a queue (~1 min).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# Decode steps take ~ms; stalls (preemption, a long prefill in the same batch) reach seconds.
INTER_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ENCODER_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _ReportedHistogram(Collector):
    """A histogram the engine keeps (per-bound counts and a sum, as its stats
    last reported them), per value of one label."""

    def __init__(self, name: str, documentation: str, label: str | None = None) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.buckets: list[float] = []
        self.series: dict[str, tuple[list[int], float]] = {}  # label value -> (counts, sum)

    def set(self, buckets: list[float], counts: list[int], total: float, label_value: str = "") -> None:
        self.buckets = list(buckets)
        self.series[label_value] = (list(counts), total)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        if not self.buckets:
            return
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label] if self.label else None)
        for value, (counts, total) in self.series.items():
            cumulative, running = [], 0
            for bound, count in zip([*map(str, self.buckets), "+Inf"], counts):
                running += count
                cumulative.append((bound, running))
            family.add_metric([value] if self.label else [], cumulative, total)
        yield family


class ServerMetrics:
    content_type: str = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "swallow_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.request_errors = Counter(
            "swallow_request_errors", "HTTP requests answered with status >= 400", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "swallow_time_to_first_token_seconds", "Time from request arrival to first token",
            buckets=TTFT_BUCKETS, registry=r,
        )
        self.inter_token = Histogram(
            "swallow_inter_token_latency_seconds", "Time between consecutive streamed tokens",
            buckets=INTER_TOKEN_BUCKETS, registry=r,
        )
        self.waiting = Gauge("swallow_requests_waiting", "Requests queued for the engine", registry=r)
        self.running = Gauge("swallow_requests_running", "Requests the engine is generating for", registry=r)
        self.pool_capacity = Gauge("swallow_kv_pool_capacity_tokens", "KV pool size in tokens", ["pool"], registry=r)
        self.pool_used = Gauge("swallow_kv_pool_used_tokens", "KV pool tokens in use", ["pool"], registry=r)
        self.pool_usage = Gauge("swallow_kv_pool_usage_ratio", "KV pool fraction in use (0..1)", ["pool"], registry=r)
        self.pool_used_bytes = Gauge("swallow_kv_pool_used_bytes", "KV bytes in use in a pool", ["pool"], registry=r)
        self.pool_token_bytes = Gauge("swallow_kv_pool_bytes_per_token", "KV bytes one token takes in a pool "
                                      "(all of the pool's layers)", ["pool"], registry=r)
        # What SWA saves, as one number to set beside the pools' bytes: a model of the
        # same shape whose sliding-window layers attended to everything would hold
        # every layer's KV for each token the full pool holds now.
        self.full_attention_bytes = Gauge(
            "swallow_kv_full_attention_equivalent_bytes",
            "KV bytes a full-attention model of the same shape would hold for the tokens held now", registry=r)
        self.prefix_hit_rate = Gauge(
            "swallow_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache", registry=r
        )
        self.prefix_cached_tokens = Gauge(
            "swallow_prefix_cache_cached_tokens", "Prompt tokens served from the prefix cache since start", registry=r
        )
        # A gauge, not a counter: it mirrors the engine's own running total.
        self.preemptions = Gauge("swallow_preemptions", "Requests preempted by the scheduler since start", registry=r)
        self.recompiles = Counter("swallow_recompiles", "Graphs compiled after the engine reported ready "
                                  "(0 when the warm-up covered every shape serving met)", registry=r)
        self._recompiles_seen = 0
        self.weights_bytes = Gauge("swallow_weights_resident_bytes", "Bytes the model's weights take on the device",
                                   registry=r)
        # Gauges mirroring the engine's running totals, one series per draft position.
        self.drafts_proposed = Gauge("swallow_spec_drafts_proposed", "MTP draft tokens verified, by draft position",
                                     ["position"], registry=r)
        self.drafts_accepted = Gauge("swallow_spec_drafts_accepted", "MTP draft tokens accepted, by draft position",
                                     ["position"], registry=r)
        self.acceptance_length = Gauge(
            "swallow_spec_mean_acceptance_length",
            "Tokens per speculative verify step (accepted drafts + the target's own)", registry=r,
        )
        self.cached_tokens_by_tier = Gauge(
            "swallow_prefix_cache_cached_tokens_by_tier",
            "Prompt tokens served from the prefix cache since start, by where their KV was", ["tier"], registry=r,
        )
        self.tier_used = Gauge("swallow_kv_tier_used_bytes", "Bytes held by a KV tier", ["tier"], registry=r)
        self.tier_capacity = Gauge("swallow_kv_tier_capacity_bytes", "Byte budget of a KV tier", ["tier"],
                                   registry=r)
        self.tier_moved = Gauge("swallow_kv_tier_bytes", "KV bytes moved since start: demoted (device to host), "
                                "spilled (host to disk), restored (to the device, by tier)", ["direction", "tier"],
                                registry=r)
        self.tier_checksum_failures = Gauge(
            "swallow_kv_tier_checksum_failures", "Stored KV entries found corrupt, short or missing", registry=r)
        self.tier_load_failures = Gauge(
            "swallow_kv_tier_load_failures", "Restores that failed and were recomputed", registry=r)
        self.restore_latency = _ReportedHistogram("swallow_kv_restore_seconds", "Time to restore one KV entry from a tier")
        self.bucket_queue_wait = _ReportedHistogram(
            "swallow_queue_wait_seconds", "Arrival to first admission, by prompt-length bucket", "bucket")
        self.bucket_ttft = _ReportedHistogram(
            "swallow_bucket_ttft_seconds", "Arrival to first token in the engine, by prompt-length bucket", "bucket")
        for collector in (self.restore_latency, self.bucket_queue_wait, self.bucket_ttft):
            r.register(collector)
        self.encoder_batch = Histogram(
            "swallow_encoder_batch_size", "Items per encoder batch", ["encoder"],
            buckets=ENCODER_BATCH_BUCKETS, registry=r,
        )
        self.embedding_cache = Counter(
            "swallow_embedding_cache_requests", "Embedding cache lookups", ["kind", "result"], registry=r
        )
        # The stack's router: gauges mirroring its running totals and each worker's load.
        self.route_decisions = Gauge("swallow_route_decisions", "Requests routed since start, by worker and why "
                                     "(affinity: a reusable prefix there; miss: nobody had one, least loaded)",
                                     ["worker", "reason"], registry=r)
        self.worker_queued_tokens = Gauge("swallow_worker_queued_tokens", "Prompt tokens routed to a worker and "
                                          "not yet computed", ["worker"], registry=r)
        self.worker_running = Gauge("swallow_worker_running_requests", "Requests a worker runs", ["worker"],
                                    registry=r)
        self.worker_routed_cached = Gauge("swallow_worker_routed_cached_tokens", "Prompt tokens routed to a worker "
                                          "that it was expected to reuse", ["worker"], registry=r)
        self.prompt_tokens = Counter("swallow_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("swallow_generation_tokens", "Tokens generated", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def summary(self) -> dict[str, Any]:
        """The demo page's panel: what SWA saves and what the caches reuse, read
        back from this registry, so every number is one ``/metrics`` shows."""
        value = self.registry.get_sample_value

        def pool(name: str, metric: str) -> float:
            return value(metric, {"pool": name}) or 0.0

        in_use = pool("full", "swallow_kv_pool_used_bytes") + pool("swa", "swallow_kv_pool_used_bytes")
        full_attention = value("swallow_kv_full_attention_equivalent_bytes") or 0.0
        encoders = {}
        for encoder in ("vision", "audio"):
            batches = value("swallow_encoder_batch_size_count", {"encoder": encoder}) or 0.0
            items = value("swallow_encoder_batch_size_sum", {"encoder": encoder}) or 0.0
            encoders[encoder] = {"batches": int(batches), "items": int(items),
                                 "mean_batch_size": round(items / batches, 3) if batches else 0.0}
        lookups = {result: self._total("swallow_embedding_cache_requests_total", result=result)
                   for result in ("hit", "miss")}
        # The same memory given to a full-attention model of the same shape: every
        # token would take every layer's KV.
        memory = sum(pool(p, "swallow_kv_pool_capacity_tokens") * pool(p, "swallow_kv_pool_bytes_per_token")
                     for p in ("full", "swa"))
        every_layer = pool("full", "swallow_kv_pool_bytes_per_token") + pool("swa", "swallow_kv_pool_bytes_per_token")
        capacity = int(pool("full", "swallow_kv_pool_capacity_tokens"))
        capacity_full_attention = int(memory // every_layer) if every_layer else 0
        return {
            "kv_capacity_tokens": capacity,
            "kv_capacity_tokens_full_attention": capacity_full_attention,
            "kv_capacity_gain": round(capacity / capacity_full_attention, 3) if capacity_full_attention else None,
            "kv_bytes_in_use": int(in_use),
            "kv_bytes_full_attention": int(full_attention),
            "kv_saving_ratio": round(full_attention / in_use, 3) if in_use else None,
            "full_pool_tokens_used": int(pool("full", "swallow_kv_pool_used_tokens")),
            "full_pool_capacity_tokens": int(pool("full", "swallow_kv_pool_capacity_tokens")),
            "swa_slots_used": int(pool("swa", "swallow_kv_pool_used_tokens")),
            "swa_slots_capacity": int(pool("swa", "swallow_kv_pool_capacity_tokens")),
            "prefix_cache_hit_rate": value("swallow_prefix_cache_hit_rate") or 0.0,
            "prefix_cache_cached_tokens": int(value("swallow_prefix_cache_cached_tokens") or 0),
            "embedding_cache_hits": int(lookups["hit"]),
            "embedding_cache_misses": int(lookups["miss"]),
            "encoder_batches": encoders,
            "requests_running": int(value("swallow_requests_running") or 0),
            "requests_waiting": int(value("swallow_requests_waiting") or 0),
        }

    def _total(self, sample: str, **labels: str) -> float:
        """The sum of ``sample``'s series whose labels include ``labels``."""
        return sum(point.value for family in self.registry.collect() for point in family.samples
                   if point.name == sample and labels.items() <= point.labels.items())

    def observe_request(self, endpoint: str, status: int) -> None:
        labels = {"endpoint": endpoint, "status": str(status)}
        self.requests.labels(**labels).inc()
        if status >= 400:
            self.request_errors.labels(**labels).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)

    def set_queue_depth(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def _mirror_recompiles(self, seen: int) -> None:
        """The engine's count as a counter: what it added since last time (all
        of it after a restarted engine, whose count starts over)."""
        self.recompiles.inc(seen - self._recompiles_seen if seen >= self._recompiles_seen else seen)
        self._recompiles_seen = seen

    def set_engine_stats(self, stats: dict[str, Any]) -> None:
        """Mirror `LLM.stats()`: KV pools, prefix cache, queue depth, preemptions."""
        pools = {key.removesuffix("_pool"): pool for key, pool in stats.items()
                 if key.endswith("_pool") and isinstance(pool, dict)}
        for name, pool in pools.items():
            self._set_pool(name, pool)
        if "full" in pools:
            every_layer = sum(pool.get("bytes_per_token", 0) for pool in pools.values())
            self.full_attention_bytes.set(_used_tokens(pools["full"]) * every_layer)
        cache = stats.get("prefix_cache")
        if cache is not None:  # None: prefix caching is off, nothing to report
            self.prefix_hit_rate.set(cache.get("hit_rate", 0.0))
            self.prefix_cached_tokens.set(cache.get("cached_prompt_tokens", 0))
            for tier, tokens in cache.get("cached_tokens_by_tier", {}).items():
                self.cached_tokens_by_tier.labels(tier=tier).set(tokens)
        tiers = stats.get("kv_tiers")
        if tiers:
            self._set_tiers(tiers)
        if schedule := stats.get("schedule"):
            self._set_schedule(schedule)
        self.set_queue_depth(stats.get("waiting_requests", 0), stats.get("running_requests", 0))
        self.preemptions.set(stats.get("preemptions", 0))
        if compiled := stats.get("compile"):
            self._mirror_recompiles(int(compiled.get("recompiles_after_ready") or 0))
        if weights := stats.get("weights"):
            self.weights_bytes.set(weights.get("resident_bytes", 0))
        if routing := stats.get("routing"):
            self._set_routing(routing)
        spec = stats.get("speculative")
        if spec and isinstance(spec.get("num_speculative_tokens"), int) and spec.get("num_speculative_tokens"):
            for i, (proposed, accepted) in enumerate(zip(spec["drafts_proposed"], spec["drafts_accepted"])):
                self.drafts_proposed.labels(position=str(i + 1)).set(proposed)
                self.drafts_accepted.labels(position=str(i + 1)).set(accepted)
            self.acceptance_length.set(spec.get("mean_acceptance_length") or 0.0)

    def _set_routing(self, routing: dict[str, Any]) -> None:
        # Workers come and go: only the live ones have series.
        for gauge in (self.route_decisions, self.worker_queued_tokens, self.worker_running, self.worker_routed_cached):
            gauge.clear()
        for worker, reasons in routing.get("decisions", {}).items():
            for reason, count in reasons.items():
                self.route_decisions.labels(worker=worker, reason=reason).set(count)
        for worker, load in routing.get("workers", {}).items():
            self.worker_queued_tokens.labels(worker=worker).set(load["queued_tokens"])
            self.worker_running.labels(worker=worker).set(load["running"])
            self.worker_routed_cached.labels(worker=worker).set(load["routed_cached_tokens"])

    def _set_tiers(self, tiers: dict[str, Any]) -> None:
        for tier in ("host", "disk"):
            self.tier_used.labels(tier=tier).set(tiers[f"{tier}_bytes_used"])
            self.tier_capacity.labels(tier=tier).set(tiers[f"{tier}_bytes_capacity"])
            self.tier_moved.labels(direction="restored", tier=tier).set(tiers["restored_bytes"][tier])
        self.tier_moved.labels(direction="demoted", tier="host").set(tiers["demoted_bytes"])
        self.tier_moved.labels(direction="spilled", tier="disk").set(tiers["spilled_bytes"])
        self.tier_checksum_failures.set(tiers["checksum_failures"])
        self.tier_load_failures.set(tiers["load_failures"])
        self.restore_latency.set(tiers["restore_seconds_buckets"], tiers["restore_seconds_counts"],
                                 tiers["restore_seconds_sum"])

    def _set_schedule(self, schedule: dict[str, Any]) -> None:
        bounds = schedule["latency_buckets_s"]
        for label, bucket in schedule["buckets"].items():
            self.bucket_queue_wait.set(bounds, bucket["queue_wait"]["counts"], bucket["queue_wait"]["sum_s"], label)
            self.bucket_ttft.set(bounds, bucket["ttft"]["counts"], bucket["ttft"]["sum_s"], label)

    def _set_pool(self, pool: str, stats: dict[str, Any]) -> None:
        capacity = stats.get("capacity_tokens", 0)
        used = _used_tokens(stats)
        self.pool_capacity.labels(pool=pool).set(capacity)
        self.pool_used.labels(pool=pool).set(used)
        self.pool_usage.labels(pool=pool).set(used / capacity if capacity else 0.0)
        self.pool_used_bytes.labels(pool=pool).set(used * stats.get("bytes_per_token", 0))
        self.pool_token_bytes.labels(pool=pool).set(stats.get("bytes_per_token", 0))

    def observe_encoder_batch(self, encoder: str, items: int) -> None:
        self.encoder_batch.labels(encoder=encoder).observe(items)

    def count_embedding(self, kind: str, cached: bool) -> None:
        self.embedding_cache.labels(kind=kind, result="hit" if cached else "miss").inc()

    def count_tokens(self, prompt: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)


def _used_tokens(pool: dict[str, Any]) -> int:
    capacity = pool.get("capacity_tokens", 0)
    return capacity - pool.get("free_tokens", capacity)

