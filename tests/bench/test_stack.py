"""The pure parts of `swallow bench stack` (bench/stack*.py): the seeded
workload, the context bound, and the figures read from /stats snapshots. No
process is started here; the live run is `swallow bench stack --json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.stack_client import TurnResult
from bench.stack_figures import CROSS_WORKER_DEFINITION, compare_answers, policy_figures, reuse_model
from bench.stack_workload import (
    WorkloadConfig,
    build_workload,
    estimate_prompt_tokens,
    messages_for_turn,
    shared_prefix_tokens,
)
from bench.registry import bench_parser
from llm_core.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"


def test_the_workload_is_a_function_of_the_seed() -> None:
    a, b = build_workload(0), build_workload(0)
    assert a == b
    assert build_workload(1) != a
    config = WorkloadConfig(users=12, turns=4)
    assert build_workload(3, config) == build_workload(3, config)
    assert len(build_workload(3, config).conversations) == 12


def test_the_workload_has_the_mix_it_promises() -> None:
    config = WorkloadConfig()
    workload = build_workload(0, config)
    convs = workload.conversations
    assert len(convs) == config.users and all(len(c.questions) == config.turns for c in convs)
    assert all(len(c.think_s) == config.turns - 1 for c in convs)
    assert all(config.think_s[0] <= t <= config.think_s[1] for c in convs for t in c.think_s)
    kinds = [c.kind for c in convs]
    assert kinds.count("video") == round(config.users * config.video_share)
    assert "image" in kinds and "audio" in kinds and "text" in kinds
    sharers = [c for c in convs if c.shares_clip_of is not None]
    assert sharers, "some users send a clip an earlier user sent"
    for conv in sharers:
        owner = convs[conv.shares_clip_of]
        assert owner.clip == conv.clip and owner.shares_clip_of is None
        assert conv.start_s >= owner.start_s + config.share_lag_s - 1e-9
    assert len(workload.clips) == sum(c.clip is not None for c in convs) - len(sharers)
    assert workload.num_requests == config.users * config.turns
    described = workload.describe()
    assert described["requests"] == workload.num_requests and described["users_sharing_a_clip"] == len(sharers)
    json.dumps(described)


def test_each_turn_resends_the_whole_history() -> None:
    conv = next(c for c in build_workload(0).conversations if c.clip is not None)
    media = [{"type": "file", "file": {"file_id": "m0"}}]
    messages = messages_for_turn(conv, 2, ["a0", "a1"], "SYS", media)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[1]["content"] == [*media, {"type": "text", "text": conv.questions[0]}]
    assert [messages[2]["content"], messages[4]["content"]] == ["a0", "a1"]
    assert messages[5]["content"] == [{"type": "text", "text": conv.questions[2]}]
    with pytest.raises(ValueError):
        messages_for_turn(conv, 2, ["a0"], "SYS", media)


@pytest.mark.parametrize("users, turns", [(16, 5), (16, 6)])
def test_conversations_stay_under_the_context(users: int, turns: int) -> None:
    config = WorkloadConfig(users=users, turns=turns)
    workload = build_workload(0, config)
    context = ModelConfig.from_json_file(DEMO / "config.json").max_position_embeddings
    bounds = estimate_prompt_tokens(workload, DEMO)
    assert len(bounds) == users
    assert max(bounds) + config.max_tokens <= context, (max(bounds), context)
    # The system prompt matters: most of a first prompt is the shared prefix.
    assert 150 <= shared_prefix_tokens(workload, DEMO) < min(bounds)


def _stats(workers: dict[str, tuple[int, int, int]], encoder: tuple[int, int, int],
           routed: dict[str, int]) -> dict[str, Any]:
    """A stack's /stats: per worker (cached, computed, embedding rows read)."""
    return {
        "workers": {w: {"prefix_cache": {"cached_prompt_tokens": c, "computed_prompt_tokens": p},
                        "embeddings": {"read": r, "missing": 0, "bytes": 64 * r}}
                    for w, (c, p, r) in workers.items()},
        "encoders": {"encoder-0": {"upload_hits": encoder[0], "content_hits": encoder[1], "misses": encoder[2],
                                   "store": {"entries": 3}}},
        "routing": {"policy": "round-robin",
                    "workers": {w: {"routed": n, "routed_cached_tokens": workers[w][0]} for w, n in routed.items()},
                    "decisions": {w: {"round-robin": n} for w, n in routed.items()}},
    }


def _turn(user: int, turn: int, worker: str, sent: float, media: tuple[str, ...] = (), prompt: int = 100,
          answer: str = "left") -> TurnResult:
    return TurnResult(user, turn, 200, worker, answer, sent_s=sent, ttft_s=0.1 * (turn + 1), latency_s=0.2,
                      prompt_tokens=prompt, completion_tokens=2, media=media)


def test_figures_come_from_the_difference_of_the_snapshots() -> None:
    before = _stats({"worker-0": (100, 50, 3), "worker-1": (10, 10, 0)}, (1, 0, 2), {"worker-0": 4, "worker-1": 1})
    after = _stats({"worker-0": (400, 150, 6), "worker-1": (110, 310, 2)}, (4, 1, 4), {"worker-0": 7, "worker-1": 4})
    results = [
        _turn(0, 0, "worker-0", 0.0, ("clip-0",)),  # first use of clip-0: an encoder miss
        _turn(0, 1, "worker-1", 1.0, ("clip-0",)),  # hit, on another worker: cross-worker reuse
        _turn(0, 2, "worker-0", 2.0, ("clip-0",)),  # hit, same worker
        _turn(1, 0, "worker-1", 0.5, ("clip-1", "clip-1")),  # a video with a sound track: two items, misses
        _turn(1, 1, "worker-0", 1.5, ("clip-1", "clip-1")),  # two items reused on the other worker
        _turn(2, 0, "worker-0", 0.2),
    ]
    figures = policy_figures(results, before, after, wall_s=2.0)
    assert figures["completed"] == 6 and figures["errors"] == []
    w0, w1 = figures["workers"]["worker-0"], figures["workers"]["worker-1"]
    assert (w0["cached_prompt_tokens"], w0["computed_prompt_tokens"], w0["hit_rate"]) == (300, 100, 0.75)
    assert (w1["cached_prompt_tokens"], w1["computed_prompt_tokens"], w1["hit_rate"]) == (100, 300, 0.25)
    assert figures["prefix_hit_rate"] == 0.5  # (300 + 100) / (400 + 400)
    assert figures["load_max_over_mean"] == 1.5  # computed 100 and 300
    assert (w0["requests"], w1["requests"]) == (4, 2)
    assert (w0["embedding_rows_read"], w1["embedding_rows_read"]) == (3, 2)
    assert (w0["media_items_served"], w1["media_items_served"]) == (4, 3)
    assert figures["routing"]["routed"] == {"worker-0": 3, "worker-1": 3}
    assert figures["router_expected_cached_tokens"] == 400  # as the router had it: the workers' own figure
    emb = figures["embeddings"]
    assert (emb["media_items_sent"], emb["distinct_media_items"]) == (7, 3)
    assert (emb["encoder_upload_hits"], emb["encoder_content_hits"], emb["encoder_misses"]) == (3, 1, 2)
    assert emb["first_use_unambiguous"] is False  # 2 misses for 3 distinct items: the counts disagree
    assert emb["cross_worker_reuse_requests"] == 2 and emb["cross_worker_reuse_items"] == 3
    assert emb["clips_read_on_several_workers"] == 2
    assert emb["cross_worker_reuse_definition"] == CROSS_WORKER_DEFINITION
    assert figures["ttft_p50_s"] is not None and figures["requests_per_s"] == 3.0
    assert figures["output_tokens"] == 12 and len(figures["trace"]) == 6
    json.dumps(figures)


def test_repeated_runs_pool_their_tokens() -> None:
    from bench.stack import _over_runs

    before = _stats({"worker-0": (0, 0, 0)}, (0, 0, 0), {"worker-0": 0})
    results = [_turn(0, 0, "worker-0", 0.0)]
    runs = [policy_figures(results, before, _stats({"worker-0": (c, p, 0)}, (0, 0, 0), {"worker-0": 1}), 1.0)
            for c, p in ((30, 10), (10, 30))]
    out = _over_runs(runs)
    assert out["prefix_hit_rate"] == 0.75 and out["runs"]["prefix_hit_rate"] == [0.75, 0.25]
    assert out["prefix_hit_rate_pooled"] == 0.5 and out["computed_prompt_tokens_pooled"] == 40


def test_first_use_is_unambiguous_when_the_encoder_missed_each_item_once() -> None:
    before = _stats({"worker-0": (0, 0, 0)}, (0, 0, 0), {"worker-0": 0})
    after = _stats({"worker-0": (0, 10, 3)}, (2, 0, 1), {"worker-0": 3})
    results = [_turn(0, t, "worker-0", float(t), ("clip-0",)) for t in range(3)]
    emb = policy_figures(results, before, after, 1.0)["embeddings"]
    assert emb["first_use_unambiguous"] is True and emb["cross_worker_reuse_items"] == 0
    assert emb["encoder_hit_rate"] == round(2 / 3, 4)


def test_failed_turns_are_counted_not_measured() -> None:
    before = after = _stats({"worker-0": (0, 0, 0)}, (0, 0, 0), {"worker-0": 0})
    failed = TurnResult(0, 0, 503, "worker-0", None, error="worker gone")
    figures = policy_figures([failed], before, after, 1.0)
    assert figures["completed"] == 0 and len(figures["errors"]) == 1 and figures["prefix_hit_rate"] is None


def test_the_reuse_model_follows_the_routing() -> None:
    # Two users, two turns each, prompts 100 then 140 tokens; shared prefix 40 tokens, pages of 16.
    same = [_turn(0, 0, "w0", 0.0, prompt=100), _turn(1, 0, "w0", 1.0, prompt=100),
            _turn(0, 1, "w0", 2.0, prompt=140), _turn(1, 1, "w0", 3.0, prompt=140)]
    apart = [_turn(0, 0, "w0", 0.0, prompt=100), _turn(1, 0, "w1", 1.0, prompt=100),
             _turn(0, 1, "w1", 2.0, prompt=140), _turn(1, 1, "w0", 3.0, prompt=140)]
    on_one = reuse_model(same, shared_prefix_tokens=40)
    alternating = reuse_model(apart, shared_prefix_tokens=40)
    total = 480
    # one worker: user 1's first turn finds the shared prefix (32), both second turns their first (96)
    assert on_one["modelled_hit_rate"] == round((32 + 96 + 96) / total, 4)
    # alternating: w1 is cold for user 1's first turn; user 0's second turn on w1 finds the shared prefix
    # (user 1 finished there); user 1's second turn on w0 finds user 0's requests' shared prefix only
    assert alternating["modelled_hit_rate"] == round((0 + 32 + 32) / total, 4)
    assert on_one["ideal_hit_rate"] == alternating["ideal_hit_rate"] == on_one["modelled_hit_rate"]
    assert (on_one["turns_on_previous_turns_worker"], alternating["turns_on_previous_turns_worker"]) == (2, 0)
    assert on_one["shared_prefix_share"] == round(4 * 32 / total, 4)


def test_answers_are_compared_turn_by_turn() -> None:
    a = [_turn(0, 0, "worker-0", 0.0), _turn(0, 1, "worker-0", 1.0, answer="up")]
    b = [_turn(0, 0, "worker-1", 0.0), _turn(0, 1, "worker-0", 1.0, answer="up")]
    assert compare_answers({"kv-affinity": a, "round-robin": b})["answers_identical"] is True
    c = [_turn(0, 0, "worker-1", 0.0), _turn(0, 1, "worker-0", 1.0, answer="down")]
    out = compare_answers({"kv-affinity": a, "round-robin": c})
    assert out["answers_identical"] is False and out["num_answer_mismatches"] == 1
    assert out["answer_mismatches"][0] == {"user": 0, "turn": 1, "kv-affinity": "up", "round-robin": "down"}
    # A turn one policy never got to is a difference too.
    out = compare_answers({"kv-affinity": a, "round-robin": a[:1]})
    assert out["answers_identical"] is False


def test_the_cli_takes_the_stack_options() -> None:
    args = bench_parser("stack").parse_args(["--users", "4", "--turns", "2", "--workers", "3", "--json"])
    assert (args.users, args.turns, args.workers, args.json) == (4, 2, 3, True)
    args = bench_parser("load").parse_args(["--stack", "2", "--levels", "1,16"])
    assert args.stack == 2
    assert bench_parser("load").parse_args([]).stack is None
    with pytest.raises(SystemExit):  # --stack is load's: a stack bench is a stack already
        bench_parser("stack").parse_args(["--stack", "2"])
