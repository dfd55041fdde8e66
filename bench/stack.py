"""`swallow bench stack`: a multi-turn, multi-user chat workload against a live
`swallow stack`, once per route policy (kv-affinity, then round-robin), each
on a fresh stack started with the same arguments but the policy.

The workload (``build_workload``, seeded): U users, each holding a
conversation of T turns behind a shared system prompt. Every turn resends the
whole history -- the first user message with its media file (uploaded again,
as a client would), the assistant's answers as returned, the earlier
questions -- plus a new question. About half the conversations start with a
video, some with an image or an audio clip, the rest are text only; a few
users send the same clip as an earlier user, so its embedding is reused across
users (and, depending on routing, across workers). Users start staggered and
think between turns; sampling is greedy.

What is measured per policy comes from the workers' own stats (the stack's
``GET /stats``: ``workers`` holds each worker's engine stats), as the
difference of snapshots taken with the stack idle before and after the
workload: prompt tokens the prefix cache served (``cached``) against those it
computed, per worker and summed; how the computed tokens spread over the
workers; the encoders' embedding-cache hits and misses and the rows each
worker read from the shared-memory store. Latency and TTFT are the client's
(streaming). Answers must not depend on the routing: each (user, turn) answer
is compared across the policies.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from api.launch import launch_stack
from api.models import ensure_default_model
from bench import log
from bench.load_mix import engine_stats, flush_cache, pool_leaks, wait_idle

__all__ = [
    "CROSS_WORKER_DEFINITION",
    "DEFAULT_POLICIES",
    "SYSTEM_PROMPT",
    "Conversation",
    "MediaClip",
    "TurnResult",
    "Workload",
    "WorkloadConfig",
    "build_workload",
    "estimate_prompt_tokens",
    "messages_for_turn",
    "policy_figures",
    "reuse_model",
    "shared_prefix_tokens",
    "stack_bench",
]

DEFAULT_POLICIES = ("kv-affinity", "round-robin")

SYSTEM_PROMPT = (
    "You are the assistant of a video library. Users show you short clips, pictures and sound recordings and "
    "ask about them. A clip shows one coloured shape on a black background: a circle, a square or a triangle, "
    "in red, green, blue or yellow. The shape may move left, right, up or down, blink, or change colour. "
    "Answer each question with a few words only: a direction, a colour, a shape, a number, or a short "
    "description."
)

# The demo world's tasks by the media a conversation starts with (``demo/world.py``).
MEDIA_TASKS: dict[str, tuple[str, ...]] = {
    "video": ("video_direction", "video_blink", "video_color", "describe", "video_audio_beeps"),
    "image": ("image_shape", "image_color"),
    "audio": ("audio_beeps", "audio_pitch"),
}
FOLLOW_UPS: dict[str, tuple[str, ...]] = {
    "video": ("Describe the video.", "How many times does the light blink?", "What colour does the square turn?",
              "Which way does the red circle move?", "How many beeps are in the video?",
              "What colour does the circle turn?", "Which way does the blue triangle move?"),
    "image": ("What shape is in the picture?", "What colour is the square?", "What colour is the circle?",
              "What colour is the triangle?"),
    "audio": ("How many beeps do you hear?", "Are the beeps high or low?"),
    "text": ("Describe the video.", "Which way does the red circle move?", "How many times does the light blink?",
             "What colour does the square turn?", "How many beeps do you hear?", "What shape is in the picture?"),
}
# Embedding rows one media item can take with the demo model's preprocessing
# (preprocessor_config.json: 8 frames of at most 84x84 px -> at most 36 rows; a
# picture at most 9; a 4 s clip about 101): an upper bound for the context check.
MEDIA_ROWS_BOUND: dict[str, int] = {"video": 40, "image": 12, "audio": 110}


@dataclass(frozen=True)
class WorkloadConfig:
    users: int = 16
    turns: int = 5
    video_share: float = 0.5  # of the conversations; a video may have a sound track (two media items)
    image_share: float = 0.15
    audio_share: float = 0.15  # the rest are text only
    shared_clip_share: float = 0.25  # of the media conversations: send an earlier user's clip
    share_lag_s: float = 1.5  # a user sharing a clip starts at least this long after its first sender
    max_tokens: int = 24
    think_s: tuple[float, float] = (0.3, 1.5)  # between a turn's answer and the next question
    stagger_s: float = 4.0  # users start spread over this many seconds
    system_prompt: str = SYSTEM_PROMPT

    def __post_init__(self) -> None:
        if self.users < 1 or self.turns < 1:
            raise ValueError(f"need at least one user and one turn, got {self.users} users, {self.turns} turns")
        if self.video_share + self.image_share + self.audio_share > 1.0 + 1e-9:
            raise ValueError("the media shares add up to more than 1")


@dataclass(frozen=True)
class MediaClip:
    """One media file of the demo world: ``make_sample(default_rng([seed, index]), task)`` renders it."""

    name: str
    task: str
    seed: int
    index: int
    kinds: tuple[str, ...]  # the media items it becomes in a prompt, in order ("video", "audio" for a sound track)
    question: str

    @property
    def kind(self) -> str:
        return self.kinds[0]


@dataclass(frozen=True)
class Conversation:
    user: int
    clip: MediaClip | None
    questions: tuple[str, ...]  # one per turn
    start_s: float
    think_s: tuple[float, ...]  # after each turn but the last
    shares_clip_of: int | None = None  # the user who first sent this clip

    @property
    def kind(self) -> str:
        return self.clip.kind if self.clip is not None else "text"


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    seed: int
    conversations: tuple[Conversation, ...]

    @property
    def clips(self) -> list[MediaClip]:
        """The distinct clips, in order of first use."""
        return list(dict.fromkeys(c.clip for c in self.conversations if c.clip is not None))

    @property
    def num_requests(self) -> int:
        return sum(len(c.questions) for c in self.conversations)

    def describe(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for conv in self.conversations:
            kinds[conv.kind] = kinds.get(conv.kind, 0) + 1
        return {
            "seed": self.seed,
            "users": len(self.conversations),
            "turns_per_user": self.config.turns,
            "requests": self.num_requests,
            "conversations_by_first_media": kinds,
            "distinct_clips": len(self.clips),
            "users_sharing_a_clip": sum(c.shares_clip_of is not None for c in self.conversations),
            "max_tokens": self.config.max_tokens,
            "temperature": 0,
            "think_s": list(self.config.think_s),
            "stagger_s": self.config.stagger_s,
            "system_prompt_chars": len(self.config.system_prompt),
            "each_turn": "the whole history (system prompt, first user message with its media file uploaded "
                         "again, the answers as returned, earlier questions) plus a new question",
        }


def _clip(seed: int, index: int, task: str) -> MediaClip:
    from demo.world import make_scene

    scene, question, _ = make_scene(np.random.default_rng([seed, index]), task)
    return MediaClip(f"clip-{index}", task, seed, index, scene.media, question)


def build_workload(seed: int = 0, config: WorkloadConfig = WorkloadConfig()) -> Workload:
    """The conversations of ``config``: a pure function of ``seed`` and ``config``."""
    rng = np.random.default_rng([seed, 1])
    n = config.users
    counts = {kind: round(n * share) for kind, share in
              (("video", config.video_share), ("image", config.image_share), ("audio", config.audio_share))}
    while sum(counts.values()) > n:  # rounding up everywhere can overshoot
        counts[max(counts, key=counts.__getitem__)] -= 1
    kinds = [kind for kind, count in counts.items() for _ in range(count)]
    kinds += ["text"] * (n - len(kinds))
    kinds = [kinds[i] for i in rng.permutation(n)]
    starts = sorted(float(x) for x in rng.uniform(0.0, config.stagger_s, n))
    # Who sends an earlier user's clip: a seeded pick among the media users that have an earlier one.
    media_users = [u for u in range(n) if kinds[u] != "text"]
    num_sharing = round(len(media_users) * config.shared_clip_share)
    candidates = [u for u in media_users if any(kinds[v] == kinds[u] for v in media_users if v < u)]
    sharing = set(rng.choice(candidates, size=min(num_sharing, len(candidates)), replace=False).tolist()) \
        if candidates else set()
    conversations: list[Conversation] = []
    clip_index = 0
    for user in range(n):
        kind = kinds[user]
        clip, shares, start = None, None, starts[user]
        if kind != "text":
            if user in sharing:
                owners = [c for c in conversations if c.kind == kind and c.shares_clip_of is None]
                owner = owners[int(rng.integers(len(owners)))]
                clip, shares = owner.clip, owner.user
                start = max(start, owner.start_s + config.share_lag_s)
            else:
                tasks = MEDIA_TASKS[kind]
                clip = _clip(seed, clip_index, tasks[int(rng.integers(len(tasks)))])
                clip_index += 1
        pool = FOLLOW_UPS[kind]
        first = clip.question if clip is not None and shares is None else pool[int(rng.integers(len(pool)))]
        questions = (first, *(pool[int(rng.integers(len(pool)))] for _ in range(config.turns - 1)))
        think = tuple(round(float(x), 3) for x in rng.uniform(*config.think_s, config.turns - 1))
        conversations.append(Conversation(user, clip, questions, round(start, 3), think, shares))
    return Workload(config, seed, tuple(conversations))


def messages_for_turn(conv: Conversation, turn: int, answers: Sequence[str], system_prompt: str,
                      media_parts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of turn ``turn``: system prompt, history (with the media parts
    in the first user message, and the answers given), the turn's question."""
    if len(answers) < turn:
        raise ValueError(f"turn {turn} needs the {turn} answers before it, got {len(answers)}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}]
    for k in range(turn + 1):
        text = {"type": "text", "text": conv.questions[k]}
        messages.append({"role": "user", "content": [*media_parts, text] if k == 0 and media_parts else [text]})
        if k < turn:
            messages.append({"role": "assistant", "content": answers[k]})
    return messages


def _upload_parts(conv: Conversation) -> list[dict[str, Any]]:
    return [{"type": "file", "file": {"file_id": "m0"}}] if conv.clip is not None else []


def estimate_prompt_tokens(workload: Workload, model_dir: str | Path) -> list[int]:
    """An upper bound of each conversation's last prompt (its longest), with every
    answer as long as it can be (``max_tokens`` tokens, each taken as two when
    re-tokenised, to be safe) and every media item at its row bound."""
    from llm_core.chat import ChatTemplate
    from llm_core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer")
    template = ChatTemplate.from_model_dir(model_dir)
    config = workload.config
    out = []
    for conv in workload.conversations:
        last = len(conv.questions) - 1
        parts = [{"type": kind} for kind in conv.clip.kinds] if conv.clip is not None else []
        # The template renders one placeholder token per media item; the prompt has its rows.
        text = template.render(messages_for_turn(conv, last, [""] * last, config.system_prompt, parts))
        rows = sum(MEDIA_ROWS_BOUND[kind] - 1 for kind in (conv.clip.kinds if conv.clip is not None else ()))
        out.append(len(tokenizer.encode(text)) + rows + last * 2 * config.max_tokens)
    return out


# ---------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------


@dataclass
class TurnResult:
    user: int
    turn: int
    status: int | None = None
    worker: str | None = None
    answer: str | None = None
    error: str | None = None
    sent_s: float = 0.0  # since the workload started
    ttft_s: float | None = None  # request sent -> first chunk carrying text
    latency_s: float | None = None  # request sent -> [DONE]
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    media: tuple[str, ...] = ()  # clip name per media item the request carries
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.answer is not None


def write_clips(workload: Workload, directory: Path) -> dict[str, Path]:
    """Each clip of the workload as a file (mp4 / png / wav)."""
    from demo.world import make_sample, write_media

    files = {}
    for clip in workload.clips:
        sample = make_sample(np.random.default_rng([clip.seed, clip.index]), clip.task)
        (path,) = write_media(sample, directory, clip.name)
        files[clip.name] = path
    return files


async def run_workload(base_url: str, workload: Workload, files: Mapping[str, Path],
                       request_timeout_s: float = 180.0) -> list[TurnResult]:
    """Every user's conversation, concurrently; one result per turn sent."""
    results: list[TurnResult] = []
    limits = httpx.Limits(max_connections=len(workload.conversations) + 4)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0, pool=None)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(_converse(client, conv, workload.config, files, started, results)
                               for conv in workload.conversations))
    return sorted(results, key=lambda r: (r.user, r.turn))


async def _converse(client: httpx.AsyncClient, conv: Conversation, config: WorkloadConfig,
                    files: Mapping[str, Path], started: float, results: list[TurnResult]) -> None:
    await asyncio.sleep(max(0.0, conv.start_s - (time.perf_counter() - started)))
    data = files[conv.clip.name].read_bytes() if conv.clip is not None else None
    answers: list[str] = []
    for turn in range(len(conv.questions)):
        messages = messages_for_turn(conv, turn, answers, config.system_prompt, _upload_parts(conv))
        body = {"messages": messages, "max_tokens": config.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        uploads: list[tuple[str, tuple[Any, ...]]] = [("request", (None, json.dumps(body), "application/json"))]
        if conv.clip is not None and data is not None:
            uploads.append(("m0", (files[conv.clip.name].name, data)))
        result = TurnResult(conv.user, turn, sent_s=round(time.perf_counter() - started, 4),
                            media=tuple(conv.clip.name for _ in conv.clip.kinds) if conv.clip is not None else ())
        results.append(result)
        try:
            await _stream_turn(client, uploads, result)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        if not result.ok:
            return  # the history would differ from here on: the conversation ends
        assert result.answer is not None
        answers.append(result.answer)
        if turn < len(conv.think_s):
            await asyncio.sleep(conv.think_s[turn])


async def _stream_turn(client: httpx.AsyncClient, uploads: list[tuple[str, tuple[Any, ...]]],
                       result: TurnResult) -> None:
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", files=uploads) as response:
        result.status = response.status_code
        result.worker = response.headers.get("x-swallow-worker")
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")[:300]
            return
        text = ""
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                result.latency_s = time.perf_counter() - sent
                result.answer = text
                return
            payload = json.loads(data)
            if "error" in payload:
                result.error = json.dumps(payload["error"])[:300]
                return
            if payload.get("usage"):
                result.prompt_tokens = payload["usage"]["prompt_tokens"]
                result.completion_tokens = payload["usage"]["completion_tokens"]
            for choice in payload.get("choices", []):
                delta = choice.get("delta", {}).get("content") or ""
                if (delta or choice.get("finish_reason")) and result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - sent
                text += delta
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
    result.error = "the stream ended without [DONE]"


# ---------------------------------------------------------------------------------------
# Reading the stats
# ---------------------------------------------------------------------------------------


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


def _hit_rate(cached: int, computed: int) -> float | None:
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
            "hit_rate": _hit_rate(cached, computed),
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
        "prefix_hit_rate": _hit_rate(cached, computed),
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


def shared_prefix_tokens(workload: Workload, model_dir: str | Path) -> int:
    """Tokens every conversation's first prompt starts with (system prompt and the
    start of the first user message)."""
    from llm_core.chat import ChatTemplate
    from llm_core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(model_dir)
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer")
    template = ChatTemplate.from_model_dir(model_dir)
    prompts = []
    for conv in workload.conversations:
        parts = [{"type": kind} for kind in conv.clip.kinds] if conv.clip is not None else []
        prompts.append(tokenizer.encode(template.render(messages_for_turn(conv, 0, [], workload.config.system_prompt,
                                                                          parts))))
    common = min(len(p) for p in prompts)
    for i in range(common):
        if len({p[i] for p in prompts}) > 1:
            return i
    return common


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


# ---------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------


def _warm_up(url: str, files: Sequence[Path], rounds: int) -> None:
    """Each worker's first forwards and the encoder's first batch of every kind, before
    anything is measured (clips not in the workload, no system prompt)."""
    for i in range(rounds):
        for n, path in enumerate(files):
            body = {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "w"}},
                                                              {"type": "text", "text": f"Warm up {i} {n}."}]}],
                    "max_tokens": 4, "temperature": 0}
            response = httpx.post(f"{url}/v1/chat/completions", timeout=180,
                                  files=[("request", (None, json.dumps(body), "application/json")),
                                         ("w", (path.name, path.read_bytes()))])
            response.raise_for_status()


def _warm_up_files(seed: int, directory: Path) -> list[Path]:
    from demo.world import make_sample, write_media

    paths = []
    for i, task in enumerate(("video_audio_beeps", "image_shape", "audio_beeps")):
        sample = make_sample(np.random.default_rng([seed, 10_000 + i]), task)
        paths += write_media(sample, directory, f"warm-{i}")
    return paths


def run_policy(model_dir: str | Path, policy: str, workload: Workload, files: Mapping[str, Path],
               warm_files: Sequence[Path], *, workers: int, stack_args: Sequence[str] = (),
               shared_prefix: int = 0, log: Callable[[str], None] | None = None) -> tuple[dict[str, Any], list[TurnResult]]:
    started = time.perf_counter()
    with launch_stack(model_dir, "--route-policy", policy, *stack_args, workers=workers) as stack:
        startup_s = time.perf_counter() - started
        if log:
            log(f"{policy}: stack up in {startup_s:.1f} s; warming up")
        _warm_up(stack.url, warm_files, rounds=workers)
        flush_cache(stack.url)  # the warm-up's prefixes are not the workload's
        before = wait_idle(stack.url)
        if log:
            log(f"{policy}: {workload.num_requests} requests from {len(workload.conversations)} users")
        t0 = time.perf_counter()
        results = asyncio.run(run_workload(stack.url, workload, files))
        wall_s = time.perf_counter() - t0
        after = wait_idle(stack.url)
        leaks = pool_leaks(flush_cache(stack.url))
        logged = _logged_exceptions(stack.log())
        policy_reported = engine_stats(stack.url).get("routing", {}).get("policy")
    figures = policy_figures(results, before, after, wall_s, shared_prefix)
    figures |= {"policy_reported": policy_reported, "stack_startup_s": round(startup_s, 1),
                "kv_held_after_flush": leaks, "stack_log_tracebacks": logged,
                "runtime_s": round(time.perf_counter() - started, 1)}
    if log:
        log(f"{policy}: prefix hit rate {figures['prefix_hit_rate']}, {figures['completed']}/{figures['requests']} "
            f"completed in {wall_s:.1f} s")
    return figures, results


def _logged_exceptions(log: str) -> int:
    chained = log.count("The above exception was the direct cause") + log.count("During handling of the above")
    return log.count("Traceback (most recent call last)") - chained


_PER_RUN = ("prefix_hit_rate", "cached_prompt_tokens", "computed_prompt_tokens", "router_expected_cached_tokens",
            "load_max_over_mean", "ttft_p50_s", "ttft_p90_s", "latency_p50_s", "latency_p90_s", "output_tok_s",
            "completed")


def _over_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The first run's figures in full, each run's headline figures, and the hit rate
    pooled over the runs (their cached and computed tokens summed)."""
    out = dict(runs[0])
    cached = sum(r["cached_prompt_tokens"] for r in runs)
    computed = sum(r["computed_prompt_tokens"] for r in runs)
    out["runs"] = {key: [r[key] for r in runs] for key in _PER_RUN} | {
        "cross_worker_reuse_items": [r["embeddings"]["cross_worker_reuse_items"] for r in runs],
        "turns_on_previous_turns_worker": [r["reuse_model"]["turns_on_previous_turns_worker"] for r in runs],
        "kv_held_after_flush": [r.get("kv_held_after_flush") for r in runs],
    }
    out["prefix_hit_rate_pooled"] = _hit_rate(cached, computed)
    out["computed_prompt_tokens_pooled"] = computed
    return out


def stack_bench(
    model_dir: str | Path,
    workers: int = 2,
    users: int = 16,
    turns: int = 5,
    seed: int = 0,
    *,
    repeats: int = 1,
    policies: Sequence[str] = DEFAULT_POLICIES,
    config: WorkloadConfig | None = None,
    stack_args: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The workload ``repeats`` times per policy (policies alternating), each run on a
    fresh `swallow stack --workers WORKERS`; one JSON-ready dict. Per policy: the
    first run's figures in full, every run's headline figures under ``runs``, and
    the hit rate pooled over the runs (round-robin's depends on how arrivals
    interleave, so it varies from run to run)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    started = time.perf_counter()
    config = config or WorkloadConfig(users=users, turns=turns)
    workload = build_workload(seed, config)
    bound = max(estimate_prompt_tokens(workload, model_dir))
    shared = shared_prefix_tokens(workload, model_dir)
    figures: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    runs: dict[str, list[TurnResult]] = {}
    with tempfile.TemporaryDirectory(prefix="swallow-bench-stack-") as tmp:
        files = write_clips(workload, Path(tmp))
        warm = _warm_up_files(seed, Path(tmp))
        for i in range(repeats):
            for policy in policies:
                run, runs[f"{policy} #{i + 1}"] = run_policy(model_dir, policy, workload, files, warm,
                                                             workers=workers, stack_args=stack_args,
                                                             shared_prefix=shared, log=log)
                figures[policy].append(run)
    per_policy = {policy: _over_runs(runs_of) for policy, runs_of in figures.items()}
    out: dict[str, Any] = {
        "model": str(model_dir),
        "workers": workers,
        "repeats": repeats,
        "workload": workload.describe() | {"prompt_tokens_bound": bound, "shared_prefix_tokens": shared,
                                       "conversations": [
            {"user": c.user, "first_media": c.kind, "clip": c.clip.name if c.clip else None,
             "clip_task": c.clip.task if c.clip else None, "shares_clip_of": c.shares_clip_of,
             "start_s": c.start_s, "questions": list(c.questions)} for c in workload.conversations]},
        "policies": per_policy,
    }
    if "kv-affinity" in per_policy and "round-robin" in per_policy:
        kv, rr = per_policy["kv-affinity"], per_policy["round-robin"]
        out["kv_affinity_vs_round_robin_hit_rate"] = _ratio(kv["prefix_hit_rate_pooled"],
                                                            rr["prefix_hit_rate_pooled"])
        out["kv_affinity_vs_round_robin_hit_rate_per_run"] = [
            _ratio(a, b) for a, b in zip(kv["runs"]["prefix_hit_rate"], rr["runs"]["prefix_hit_rate"], strict=True)]
        out["kv_affinity_vs_round_robin_computed_tokens"] = _ratio(kv["computed_prompt_tokens_pooled"],
                                                                   rr["computed_prompt_tokens_pooled"])
    out |= compare_answers(runs)
    out["runtime_s"] = round(time.perf_counter() - started, 1)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint to serve (default: the demo model)")
    parser.add_argument("--workers", type=int, default=2, help="LLM workers of each stack")
    parser.add_argument("--users", type=int, default=16, help="users, each holding one conversation")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--repeats", type=int, default=2, help="runs per policy")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else ensure_default_model()
    return stack_bench(model, workers=args.workers, users=args.users, turns=args.turns, seed=args.seed,
                       repeats=args.repeats, log=log)
