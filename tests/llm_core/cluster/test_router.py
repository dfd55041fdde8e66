"""Route policies: kv-affinity goes where the window-safe prefix is (never
where only full pages are left), misses and overloads go to the least
loaded, round-robin cycles, a removed worker hands back its requests."""

from __future__ import annotations

import pytest

from llm_core.sched.cache_sim import CacheSimulator
from llm_core.kv.kv_events import KVEventLog
from llm_core.kv.tiers.kv_tiers import FULL, SWA
from llm_core.kv.prefix_cache_records import RadixNode
from llm_core.kv.page_address import CacheGeometry, token_page_addresses
from llm_core.cluster.router import NoWorkers, Router

PAGE = 4
GEOMETRY = CacheGeometry(b"\x07" * 16, PAGE, window_tokens=5)  # a window spans two pages
PROMPT = list(range(1, 42))  # 10 full pages and one token


class Workers:
    """Workers whose caches are told to the router as KV events."""

    def __init__(self, router: Router, names: str) -> None:
        self.router = router
        self.logs = {name: KVEventLog() for name in names}
        for name in names:
            router.add_worker(name, GEOMETRY)

    def hold(self, worker: str, tokens: list[int], pages: int, windows: range | None = None) -> None:
        """Full KV of the first ``pages`` pages of ``tokens``; SWA KV of the
        pages in ``windows`` (default: all of them)."""
        log = self.logs[worker]
        addresses = token_page_addresses(GEOMETRY, tokens)[:pages]
        for i, address in enumerate(addresses):
            log.record("device", address, FULL, 1)
            if windows is None or i in windows:
                log.record("device", address, SWA, PAGE)
        assert self.router.apply_events(worker, log.drain())


def test_affinity_goes_to_the_window_safe_prefix_not_to_more_full_pages() -> None:
    router = Router()
    workers = Workers(router, "ab")
    # a: all ten pages' full KV, but SWA only for pages 2-3 (a checkpoint at 16
    # tokens; the later windows were evicted); b: six pages, window intact.
    workers.hold("a", PROMPT, 10, windows=range(2, 4))
    workers.hold("b", PROMPT, 6)
    assert router.cached_tokens(PROMPT) == {"a": 16, "b": 24}
    decision = router.route("r", PROMPT)
    assert (decision.worker_id, decision.cached_tokens, decision.reason) == ("b", 24, "affinity")
    assert decision.best_cached_tokens == 24


def _node(sim: CacheSimulator, tokens: list[int], pages: int) -> RadixNode:
    node = sim.cache.root
    for key in sim.cache.page_keys(tokens)[:pages]:
        node = node.children[key]
    return node


def test_a_worker_whose_window_was_evicted_loses_the_request_through_real_events() -> None:
    router = Router()
    sims = {}
    for name in "ab":
        log = KVEventLog()
        sims[name] = (CacheSimulator(PAGE, window=6, full_tokens=400, swa_tokens=200, chunk=16, events=log), log)
        router.add_worker(name, sims[name][0].cache.geometry())
    a, b = sims["a"][0], sims["b"][0]
    # a: the prompt, then two branches off it (its pages stay as inner nodes);
    # b: the prompt's first six pages only.
    a.run(PROMPT, [100])
    a.run(PROMPT[:40] + [200] * 8, [201])
    a.run(PROMPT[:40] + [300] * 8, [301])
    b.run(PROMPT[:24] + [400], [401])
    for name, (_, log) in sims.items():
        router.apply_events(name, log.drain())
    assert router.cached_tokens(PROMPT + [7]) == {"a": 40, "b": 24}
    # a's cache drops the SWA of the prompt's last window (pressure elsewhere):
    # its full pages stay, tombstoned, and still cover the whole prompt.
    for pages in (9, 10):
        a.cache.drop_swa(_node(a, PROMPT, pages))
    router.apply_events("a", sims["a"][1].drain())
    assert _node(a, PROMPT, 10).alive and _node(a, PROMPT, 10).swa is None
    cached = router.cached_tokens(PROMPT + [7])
    assert cached["b"] == 24 and cached["a"] < 24  # a falls back to an earlier window-safe point, if any
    assert cached["a"] == a.cache.peek(a.cache.page_keys(PROMPT + [7]), max_pages=10).device
    assert router.route("r", PROMPT + [7]).worker_id == "b"


def test_a_miss_goes_to_the_least_loaded_worker() -> None:
    router = Router()
    Workers(router, "abc")
    router.report_load("a", queued_tokens=5_000, running=3)
    router.report_load("b", queued_tokens=100, running=9)
    router.report_load("c", queued_tokens=2_000, running=0)
    decision = router.route("r", PROMPT)
    assert (decision.worker_id, decision.cached_tokens, decision.reason) == ("b", 0, "miss")
    # Its own prompt now counts in b's queue until its prefill is done.
    assert router.state("b").outstanding_tokens == len(PROMPT)
    router.prefill_done("r")
    assert router.state("b").outstanding_tokens == 0


def test_misses_spread_by_the_work_routed_so_far() -> None:
    router = Router()
    Workers(router, "abc")
    sizes = [400] + [40] * 9
    for i, n in enumerate(sizes):
        router.route(i, [1000 * i + t for t in range(n)])
        router.prefill_done(i)  # nothing stays queued: only the work done differs
    work = {w: load["routed_uncached_tokens"] for w, load in router.loads().items()}
    # The 400-token prompt's worker gets no more misses until the others catch up.
    assert sorted(work.values()) == [160, 200, 400]


def test_the_load_term_moves_a_request_off_an_overloaded_worker() -> None:
    router = Router(max_load_ratio=1e9)  # the queue alone (the load bound is tested below)
    workers = Workers(router, "ab")
    workers.hold("a", PROMPT, 10)
    cached = router.cached_tokens(PROMPT)["a"]
    assert cached == 40
    # Queued work worth less than the reuse: the request stays with its cache.
    router.report_load("a", queued_tokens=int(0.5 * cached / router.load_weight), running=1)
    assert router.route("r1", PROMPT).worker_id == "a"
    router.prefill_done("r1")
    # Worth more: it goes where it will compute everything but start first.
    router.report_load("a", queued_tokens=int(2 * cached / router.load_weight) + 1, running=1)
    decision = router.route("r2", PROMPT)
    assert (decision.worker_id, decision.cached_tokens, decision.reason) == ("b", 0, "load")
    assert decision.best_cached_tokens == 40


def test_a_worker_over_the_load_bound_gives_up_its_cached_requests() -> None:
    router = Router(max_load_ratio=1.25)
    workers = Workers(router, "ab")
    workers.hold("a", PROMPT, 10)
    # Misses spread the work evenly; then a's sessions keep coming back to it
    # with new tokens to compute (each time 40 cached, 400 new).
    for i in range(8):
        router.route(f"m{i}", [10_000 * (i + 1) + t for t in range(400)])
        router.prefill_done(f"m{i}")
    follow_up = PROMPT[:40] + list(range(5_000, 5_400))
    reasons = []
    for i in range(12):
        decision = router.route(f"f{i}", follow_up)
        router.prefill_done(f"f{i}")  # no queue: only the work done differs
        reasons.append(decision.reason)
        work = {w: load["work_tokens"] for w, load in router.loads().items()}
        # Never more than c x the mean plus about one request (440 tokens).
        assert max(work.values()) <= 1.25 * sum(work.values()) / 2 + 2 * 440
    assert reasons[0] == "affinity" and "balance" in reasons
    # Without the bound (a huge c) a keeps them all.
    unbounded = Router(max_load_ratio=1e9)
    Workers(unbounded, "ab").hold("a", PROMPT, 10)
    for i in range(12):
        assert unbounded.route(i, follow_up).worker_id == "a"
        unbounded.prefill_done(i)


def test_a_worker_that_joins_late_starts_level_with_the_others() -> None:
    router = Router()
    Workers(router, "ab")
    for i in range(10):
        router.route(i, [100 * i + t for t in range(50)])
        router.prefill_done(i)
    router.add_worker("c", GEOMETRY)
    assert router.loads()["c"]["work_tokens"] == 250
    # It takes its share of the next misses, not all of them.
    picks = [router.route(f"n{i}", [7_000 + 100 * i + t for t in range(50)]).worker_id for i in range(9)]
    assert {picks.count(w) for w in "abc"} == {3}


def test_round_robin_cycles_and_ignores_the_cache() -> None:
    router = Router("round-robin")
    workers = Workers(router, "abc")
    workers.hold("a", PROMPT, 10)
    picks = [router.route(i, PROMPT) for i in range(7)]
    assert [d.worker_id for d in picks] == list("abcabca")
    assert {d.reason for d in picks} == {"round-robin"}
    assert [d.cached_tokens for d in picks[:3]] == [40, 0, 0]


def test_least_load_ignores_the_cache() -> None:
    router = Router("least-load")
    workers = Workers(router, "ab")
    workers.hold("a", PROMPT, 10)
    router.report_load("a", queued_tokens=10, running=0)
    assert router.route("r", PROMPT).worker_id == "b"


def test_remove_worker_returns_its_unfinished_requests() -> None:
    router = Router("round-robin")
    Workers(router, "ab")
    for i in range(6):
        router.route(i, PROMPT)
    router.prefill_done(0)  # prefilled, still decoding: the router forgets it either way
    assert sorted(router.remove_worker("a")) == [2, 4]
    assert router.workers == ["b"]
    assert {router.route(i, PROMPT).worker_id for i in range(6, 9)} == {"b"}
    assert router.remove_worker("a") == []
    router.remove_worker("b")
    with pytest.raises(NoWorkers):
        router.route("x", PROMPT)


def test_decisions_are_counted_per_worker_and_reason() -> None:
    router = Router()
    workers = Workers(router, "ab")
    workers.hold("a", PROMPT, 10)
    for i in range(3):
        router.route(i, PROMPT)  # a: affinity
    router.route(3, list(range(500, 540)))  # nobody has it
    assert router.decisions[("a", "affinity")] == 3
    assert router.decisions[("b", "miss")] == 1
    assert sum(router.decisions.values()) == 4
    assert router.loads()["a"]["routed"] == 3 and router.loads()["a"]["routed_cached_tokens"] == 120


def test_unknown_policies_and_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="route policy"):
        Router("random")
    with pytest.raises(ValueError):
        Router(load_weight=-1)


def test_with_decode_workers_prompts_go_to_the_others_and_decodes_to_the_least_busy() -> None:
    geometry = CacheGeometry(b"fp", 4, 8, False)
    router = Router("kv-affinity")
    router.add_worker("p", geometry, "prefill")
    router.add_worker("d0", geometry, "decode")
    router.add_worker("d1", geometry, "decode")
    picks = []
    for i in range(4):
        decision = router.route(i, list(range(40 + i)))
        assert decision.worker_id == "p"
        picks.append(router.pick_decode(i, decision.worker_id))
    assert sorted(picks) == ["d0", "d0", "d1", "d1"]
    assert router.loads()["d0"]["decoding"] == 2
    for i in range(4):
        router.decode_done(i)
    assert router.loads()["d0"]["decoding"] == router.loads()["d1"]["decoding"] == 0
    router.report_load("d0", 0, running=5)
    assert router.pick_decode(9, "p") == "d1"


def test_a_worker_doing_both_decodes_its_own_and_decode_workers_alone_still_serve() -> None:
    geometry = CacheGeometry(b"fp", 4, 8, False)
    router = Router("kv-affinity")
    router.add_worker("both", geometry)
    router.add_worker("d", geometry, "decode")
    assert router.route(1, [1, 2, 3]).worker_id == "both"
    assert router.pick_decode(1, "both") is None
    router.remove_worker("both")
    assert router.route(2, [1, 2, 3]).worker_id == "d"  # any worker can prefill
    assert router.pick_decode(2, "d") is None
