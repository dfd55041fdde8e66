"""What `swallow bench stack` reports of one policy's run, from the workers'
own stats (the stack's ``GET /stats``: ``workers`` holds each worker's
engine stats), as the difference of snapshots taken with the stack idle
before and after the workload: prompt tokens the prefix cache served
(``cached``) against those it computed, per worker and summed; how the
computed tokens spread over the workers; the encoders' embedding-cache hits
and misses and the rows each worker read from the shared-memory store.
Latency and TTFT are the client's (``TurnResult``). Answers must not depend
on the routing: ``compare_answers`` compares each (user, turn) answer across
the policies.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bench.stack_client import TurnResult

__all__ = [
    "CROSS_WORKER_DEFINITION",
    "answers_by_turn",
    "compare_answers",
    "embedding_figures",
    "hit_rate",
    "policy_figures",
    "reuse_model",
]


CROSS_WORKER_DEFINITION = (
    "media items (one per media span: a video with a sound track is two) in requests served by a worker other "
    "than the one that served the first request sending that clip, which the encoder answered from its "
    "embedding cache (every use of a clip after its first, as long as the encoders' misses equal the "
    "distinct media items -- 'first_use_unambiguous'): the worker read rows another request's encoding put "
    "in the shared-memory store, computed for a request that ran elsewhere"
)


def _percentile(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def _delta(after: Any, before: Any) -> Any:
    """after - before for the numbers of two stats dicts (missing in before: 0)."""
    if isinstance(after, Mapping):
        before = before if isinstance(before, Mapping) else {}
        return {k: _delta(v, before.get(k)) for k, v in after.items()}
    if isinstance(after, bool) or not isinstance(after, int | float):
        return after
    return after - (before if isinstance(before, int | float) and not isinstance(before, bool) else 0)


def hit_rate(cached: int, computed: int) -> float | None:
    return round(cached / (cached + computed), 4) if cached + computed else None


def policy_figures(results: Sequence[TurnResult], before: Mapping[str, Any], after: Mapping[str, Any],
                   wall_s: float, shared_prefix: int = 0) -> dict[str, Any]:
    """One policy's figures from the client's results and two /stats snapshots of the stack."""
    ok = [r for r in results if r.ok]
    workers = sorted(set(after.get("workers", {})) | {r.worker for r in ok if r.worker})
    per_worker: dict[str, dict[str, Any]] = {}
    for name in workers:
        stats_after = after.get("workers", {}).get(name, {})
        stats_before = before.get("workers", {}).get(name, {})
        cache = _delta(stats_after.get("prefix_cache", {}), stats_before.get("prefix_cache", {}))
        reads = _delta(stats_after.get("embeddings", {}), stats_before.get("embeddings", {}))
        served = [r for r in ok if r.worker == name]
        cached, computed = cache.get("cached_prompt_tokens", 0), cache.get("computed_prompt_tokens", 0)
        per_worker[name] = {
            "requests": len(served),
            "cached_prompt_tokens": cached,
            "computed_prompt_tokens": computed,
            "hit_rate": hit_rate(cached, computed),
            "client_prompt_tokens": sum(r.prompt_tokens or 0 for r in served),
            "embedding_rows_read": reads.get("read", 0),
            "embedding_reads_missing": reads.get("missing", 0),
            "media_items_served": sum(len(r.media) for r in served),
        }
    cached = sum(w["cached_prompt_tokens"] for w in per_worker.values())
    computed = sum(w["computed_prompt_tokens"] for w in per_worker.values())
    loads = [w["computed_prompt_tokens"] for w in per_worker.values()]
    mean_load = sum(loads) / len(loads) if loads else 0
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    latencies = [r.latency_s for r in ok if r.latency_s is not None]
    output_tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": [f"user {r.user} turn {r.turn}: {r.status} {r.error}" for r in results if not r.ok][:10],
        "prefix_hit_rate": hit_rate(cached, computed),
        "cached_prompt_tokens": cached,
        "computed_prompt_tokens": computed,
        "client_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "max_prompt_tokens": max((r.prompt_tokens or 0 for r in ok), default=0),
        "load_max_over_mean": round(max(loads) / mean_load, 3) if mean_load else None,
        "workers": per_worker,
        "latency_p50_s": _percentile(latencies, 50),
        "latency_p90_s": _percentile(latencies, 90),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p90_s": _percentile(ttfts, 90),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s else None,
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / wall_s, 2) if wall_s else None,
        "routing": (routing := _routing(before.get("routing", {}), after.get("routing", {}))),
        "router_expected_cached_tokens": sum(routing["routed_cached_tokens"].values()),
        "embeddings": embedding_figures(ok, before.get("encoders", {}), after.get("encoders", {})),
        "reuse_model": reuse_model(results, shared_prefix),
        "trace": [{"user": r.user, "turn": r.turn, "worker": r.worker, "sent_s": r.sent_s,
                   "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                   "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 4),
                   "latency_s": None if r.latency_s is None else round(r.latency_s, 4)} for r in results],
    }


def _routing(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    decisions = _delta(after.get("decisions", {}), before.get("decisions", {}))
    loads = _delta(after.get("workers", {}), before.get("workers", {}))
    return {
        "policy": after.get("policy"),
        "decisions": {w: {k: v for k, v in reasons.items() if v} for w, reasons in decisions.items()},
        "routed": {w: figures.get("routed", 0) for w, figures in loads.items()},
        # What the router's index (fed by the workers' KV events) expected each worker to reuse:
        # to compare with the workers' cached_prompt_tokens.
        "routed_cached_tokens": {w: figures.get("routed_cached_tokens", 0) for w, figures in loads.items()},
    }


def embedding_figures(ok: Sequence[TurnResult], encoders_before: Mapping[str, Any],
                      encoders_after: Mapping[str, Any]) -> dict[str, Any]:
    totals = {"upload_hits": 0, "content_hits": 0, "misses": 0}
    for name, stats in encoders_after.items():
        diff = _delta(stats, encoders_before.get(name, {}))
        for key in totals:
            totals[key] += diff.get(key, 0)
    with_media = sorted((r for r in ok if r.media), key=lambda r: r.sent_s)
    home: dict[str, str | None] = {}  # clip -> the worker that served its first request
    workers_of: dict[str, set[str]] = {}
    cross_items = cross_requests = 0
    for r in with_media:
        clip = r.media[0]
        if clip not in home:
            home[clip] = r.worker
        elif r.worker != home[clip]:
            cross_requests += 1
            cross_items += len(r.media)
        workers_of.setdefault(clip, set()).add(r.worker or "?")
    items = sum(len(r.media) for r in with_media)
    distinct = sum(len(next(r.media for r in with_media if r.media[0] == clip)) for clip in home)
    hits = totals["upload_hits"] + totals["content_hits"]
    return {
        "media_items_sent": items,
        "distinct_media_items": distinct,
        "encoder_upload_hits": totals["upload_hits"],
        "encoder_content_hits": totals["content_hits"],
        "encoder_misses": totals["misses"],
        "encoder_hit_rate": round(hits / (hits + totals["misses"]), 4) if hits + totals["misses"] else None,
        "first_use_unambiguous": totals["misses"] == distinct and hits == items - distinct,
        "cross_worker_reuse_items": cross_items,
        "cross_worker_reuse_requests": cross_requests,
        "cross_worker_share_of_hits": round(cross_items / hits, 4) if hits else None,
        "clips_read_on_several_workers": sum(len(ws) > 1 for ws in workers_of.values()),
        "distinct_clips": len(home),
        "cross_worker_reuse_definition": CROSS_WORKER_DEFINITION,
    }


def reuse_model(results: Sequence[TurnResult], shared_prefix_tokens: int = 0, page_size: int = 16) -> dict[str, Any]:
    """What the prefix cache could reuse given where each turn ran, from the client's
    side alone: a check on the workers' figures, and what separates the policies.

    A turn reuses, page-aligned (and never its last token), the most of (a) the
    prefix all conversations share (system prompt and the start of the first user
    message), where its worker had finished a request before this one was sent, and
    (b) the prompt of the latest earlier turn of its conversation on the same worker
    (a prefix of this turn's prompt). ``ideal``: every turn finds both (its previous
    turn on its worker). ``shared_prefix_share``: the part of all prompt tokens
    that is the shared prefix.

    An upper bound: (a) assumes the shared prefix is window-safe on a worker once it
    served any request, but the prefix cache keeps SWA only near the end of finished
    turns, so the shared prefix is reusable on a worker only after a request that
    ended shortly after it (a short first turn) finished there."""
    ok = sorted((r for r in results if r.ok and r.prompt_tokens), key=lambda r: r.sent_s)

    def aligned(n: int, prompt: int) -> int:
        return (min(n, prompt - 1) // page_size) * page_size

    finished = sorted(((r.sent_s + (r.latency_s or 0.0), r.worker) for r in ok), key=lambda x: x[0])
    last_turn: dict[tuple[int, str | None], TurnResult] = {}
    previous: dict[int, TurnResult] = {}
    modelled = ideal = shared = total = 0
    for r in ok:
        prompt = r.prompt_tokens or 0
        total += prompt
        shared += aligned(shared_prefix_tokens, prompt)
        warm = any(worker == r.worker and end <= r.sent_s for end, worker in finished)
        best = aligned(shared_prefix_tokens, prompt) if warm else 0
        mine = last_turn.get((r.user, r.worker))
        if mine is not None:
            best = max(best, aligned(mine.prompt_tokens or 0, prompt))
        modelled += best
        before = previous.get(r.user)
        ideal += max(aligned(shared_prefix_tokens, prompt) if r is not ok[0] else 0,
                     aligned(before.prompt_tokens or 0, prompt) if before is not None else 0)
        last_turn[(r.user, r.worker)] = previous[r.user] = r
    by_user: dict[int, list[TurnResult]] = {}
    for r in sorted(ok, key=lambda r: (r.user, r.turn)):
        by_user.setdefault(r.user, []).append(r)

    def rate(n: int) -> float | None:
        return round(n / total, 4) if total else None

    return {"modelled_hit_rate": rate(modelled), "ideal_hit_rate": rate(ideal), "prompt_tokens": total,
            "shared_prefix_share": rate(shared), "shared_prefix_tokens": shared_prefix_tokens,
            "turns_on_previous_turns_worker": sum(
                1 for turns in by_user.values() for a, b in itertools.pairwise(turns) if a.worker == b.worker),
            "turns_after_the_first": sum(max(0, len(turns) - 1) for turns in by_user.values()),
            "page_size": page_size}


def answers_by_turn(results: Sequence[TurnResult]) -> dict[tuple[int, int], tuple[str | None, int | None]]:
    return {(r.user, r.turn): (r.answer, r.completion_tokens) for r in results if r.ok}


def compare_answers(runs: Mapping[str, Sequence[TurnResult]]) -> dict[str, Any]:
    """Whether every (user, turn) got the same answer under every policy."""
    answers = {policy: answers_by_turn(results) for policy, results in runs.items()}
    keys = sorted(set().union(*(a.keys() for a in answers.values()))) if answers else []
    mismatches = []
    for key in keys:
        seen = {policy: a.get(key) for policy, a in answers.items()}
        if len({json.dumps(v) for v in seen.values()}) > 1:
            mismatches.append({"user": key[0], "turn": key[1], **{p: v[0] if v else None for p, v in seen.items()}})
    return {"answers_identical": bool(keys) and not mismatches, "turns_compared": len(keys),
            "answer_mismatches": mismatches[:10], "num_answer_mismatches": len(mismatches)}
