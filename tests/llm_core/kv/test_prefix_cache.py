"""Radix prefix cache: window safety, checkpoints, fallback, eviction, locks."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_core.sched.cache_sim import CacheSimulator
from llm_core.kv.prefix_cache import RadixCache
from llm_core.kv.prefix_cache_records import RadixNode

PAGE, WINDOW = 4, 9  # W = 8 tokens: a checkpoint keeps 2 pages of SWA


def _sim(full: int = 4096, swa: int = 4096, window: int = WINDOW, **kwargs) -> CacheSimulator:
    return CacheSimulator(PAGE, window, full, swa, chunk=16, **kwargs)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _nodes(cache: RadixCache) -> list[RadixNode]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        out.extend(node.children.values())
        stack.extend(node.children.values())
    return out


def _assert_clean(sim: CacheSimulator) -> None:
    """Locks balanced, no tombstone leaves, and a flush returns every slot."""
    for node in _nodes(sim.cache):
        assert node.lock == 0 and node.swa_lock == 0
        assert node.children or node.swa is not None, "tombstone leaf"
    sim.cache.flush()
    assert sim.cache.num_nodes == 0
    assert sim.allocator.full.free_slots == sim.allocator.full.capacity
    assert sim.allocator.swa.free_slots == sim.allocator.swa.capacity


def test_next_turn_hits_the_checkpoint_where_the_last_one_ended() -> None:
    sim = _sim()
    prompt, output = _tokens(1, 30), _tokens(2, 7)
    assert sim.run(prompt, output) == 0
    turn2 = prompt + output + _tokens(3, 5)
    # KV exists for the 37 tokens computed; 36 of them are page-aligned.
    assert sim.run(turn2, _tokens(4, 3)) == 36
    _assert_clean(sim)


def test_prompt_end_checkpoint_serves_a_shared_prompt() -> None:
    sim = _sim()
    system = _tokens(5, 22)
    sim.run(system, _tokens(6, 9))
    assert sim.run(system + _tokens(7, 10), [1]) == 20  # the prompt's last full page
    _assert_clean(sim)


def test_no_window_no_hit_even_with_full_kv() -> None:
    sim = _sim()
    system = _tokens(5, 40)
    sim.run(system + _tokens(8, 3), [1])
    # Full KV covers the 40 shared tokens, but SWA lives only at 40 and 43's pages.
    assert sim.run(system[:30] + _tokens(9, 10), [1]) == 0
    _assert_clean(sim)


def test_evicted_middle_window_falls_back_to_the_last_safe_checkpoint() -> None:
    sim = _sim(checkpoint_interval=16)
    prompt = _tokens(10, 64)
    sim.run(prompt, [7])
    cache = sim.cache
    keys = cache.page_keys(prompt + [1, 2, 3, 4])
    assert cache.match(keys).length == 64
    path = cache.match(keys).nodes
    for node in path[14:16] + path[10:12]:  # the windows ending at 64 and 48
        cache.drop_swa(node)
    assert cache.match(keys).length == 32  # not 0: the checkpoint at 32 survives
    _assert_clean(sim)


def test_without_fallback_a_dead_window_means_no_hit() -> None:
    sim = _sim(policy="no_checkpoints")
    prompt, output = _tokens(11, 40), _tokens(12, 4)
    sim.run(prompt, output)
    assert sim.run(prompt + output + [5, 6, 7], [1]) == 44  # exactly where it ended: a hit
    assert sim.run(prompt + [9, 9, 9, 9, 9], [1]) == 0  # full KV to 40, no window there
    _assert_clean(sim)


def test_swa_eviction_never_leaves_a_tombstone_leaf() -> None:
    sim = _sim()
    sim.run(_tokens(13, 50), _tokens(14, 3))
    leaves = [n for n in _nodes(sim.cache) if not n.children]
    assert len(leaves) == 1 and leaves[0].swa is not None
    freed = sim.cache.evict_swa(1)
    assert freed == PAGE
    # The leaf lost its window, so it (and the SWA-less pages above it) went entirely.
    assert all(n.children or n.swa is not None for n in _nodes(sim.cache))
    _assert_clean(sim)


def test_full_pool_pressure_evicts_least_recently_used_prefixes() -> None:
    sim = _sim(full=96, swa=200)  # room for about two requests of 40 tokens
    a, b, c = _tokens(20, 40), _tokens(21, 40), _tokens(22, 40)
    for prompt in (a, b, a, c):
        sim.run(prompt, [1, 2])
    assert sim.result.failed == 0
    assert sim.run(a + [3], [1]) > 0  # a was used more recently than b
    assert sim.run(b + [3], [1]) == 0
    _assert_clean(sim)


def test_locked_prefixes_are_not_evicted() -> None:
    sim = _sim()
    prompt = _tokens(30, 24)
    sim.run(prompt, [1])
    cache = sim.cache
    view = sim.allocator.new_view()
    match = cache.match(cache.page_keys(prompt + [5]))
    lock = cache.attach(view, match)
    cache.flush()
    assert cache.match(cache.page_keys(prompt + [5])).length == match.length > 0
    cache.release(lock)
    sim.allocator.free(view)
    _assert_clean(sim)


# ------------------------------------------------------------------ property
op = st.one_of(
    st.tuples(st.just("run"), st.integers(0, 3), st.integers(0, 40), st.integers(1, 12), st.integers(0, 99)),
    st.tuples(st.just("evict_swa"), st.integers(1, 40)),
    st.tuples(st.just("evict_full"), st.integers(1, 10)),
    st.tuples(st.just("lock"), st.integers(0, 3)),
    st.tuples(st.just("lock_truncate"), st.integers(0, 3), st.integers(0, 60)),
    st.tuples(st.just("unlock"),),
    st.tuples(st.just("corrupt"), st.integers(0, 1 << 30)),
    st.tuples(st.just("flush"),),  # everything unlocked leaves the device (to the tiers, if any)
)
# (host, disk) tier budgets in tokens: none, host only, a small host spilling to disk.
TIER_SIZES = [(0, 0), (200, 0), (24, 400)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=25), interval=st.sampled_from([None, 8, 12]),
       policy=st.sampled_from(["window", "no_checkpoints", "keep_all"]),
       window=st.sampled_from([9, 7, 3]),  # W = 2 pages, 1.5 pages (partial SWA pages), half a page
       tiers=st.sampled_from(TIER_SIZES))
def test_random_workloads_never_false_hit_and_never_leak(ops, interval, policy, window, tiers) -> None:  # noqa: ANN001
    # verify=True: every hit is checked against a shadow of what each slot
    # holds, and of what each tier entry holds (demotion, spill, restore).
    swa = 160 if policy == "keep_all" else 60
    sim = _sim(full=160, swa=swa, window=window, checkpoint_interval=interval, policy=policy, verify=True,
               host_tokens=tiers[0], disk_tokens=tiers[1])
    bases = [_tokens(100 + i, 48) for i in range(4)]  # shared prefixes
    held = []
    for o in ops:
        if o[0] == "run":
            _, base, keep, extra, seed = o
            prompt = bases[base][:keep] + _tokens(seed, extra)
            sim.run(prompt, _tokens(seed + 1, seed % 7))
        elif o[0] == "evict_swa":
            sim.cache.evict_swa(o[1])
        elif o[0] == "evict_full":
            sim.cache.evict_full(o[1])
        elif o[0] in ("lock", "lock_truncate"):
            view = sim.allocator.new_view()
            tokens = bases[o[1]] + [1]
            lock = None
            while lock is None:  # None: a tier entry failed to load and is forgotten
                match = sim.cache.match(sim.cache.page_keys(tokens), max_pages=len(tokens) // PAGE)
                lock = sim.cache.attach(view, match)
            held.append((view, lock))
            if o[0] == "lock_truncate" and sim.allocator.can_grow(view, view.num_tokens + 8):
                # Tentative tokens past the hit, then a rollback to anywhere,
                # the cache-owned part included.
                sim.allocator.grow(view, view.num_tokens + 8)
                sim.allocator.truncate(view, min(o[2], view.num_tokens))
        elif o[0] == "unlock" and held:
            view, lock = held.pop(0)
            sim.cache.release(lock)
            sim.allocator.free(view)
        elif o[0] == "flush":
            sim.cache.flush()
        elif o[0] == "corrupt" and sim.tiers is not None:
            # A bad page in a tier: its next load fails, as a checksum mismatch would.
            stored = [(t, k) for t in ("host", "disk") for k in sim.tiers.index(t).keys()]
            if stored:
                sim.tiers.io.corrupt(*stored[o[1] % len(stored)])  # type: ignore[union-attr]
        assert sim.result.false_hits == 0
        if sim.tiers is not None:
            for index in (sim.tiers.host, sim.tiers.disk):
                assert 0 <= index.used_bytes <= index.capacity_bytes
    for view, lock in held:
        sim.cache.release(lock)
        sim.allocator.free(view)
    _assert_clean(sim)


def test_truncating_into_a_cached_prefix_returns_only_what_the_view_owns() -> None:
    sim = _sim()
    prompt = _tokens(50, 30)
    sim.run(prompt, [1, 2])
    cache, alloc = sim.cache, sim.allocator
    view = alloc.new_view()
    match = cache.match(cache.page_keys(prompt + [9]), max_pages=len(prompt) // PAGE)
    lock = cache.attach(view, match)
    assert view.shared_swa_end > view.swa_base  # the hit's SWA window belongs to the cache
    owned_free = alloc.swa.free_slots
    alloc.grow(view, view.num_tokens + 6)
    alloc.truncate(view, view.swa_base + 1)  # into the cache-owned window
    assert alloc.swa.free_slots == owned_free  # the 6 tentative slots back, nothing of the cache's
    cache.release(lock)
    alloc.free(view)
    _assert_clean(sim)  # a slot owned twice would show here as more free slots than the pool has


def test_the_shadow_check_catches_a_hit_on_freed_slots() -> None:
    sim = _sim(verify=True)
    prompt = _tokens(40, 30)
    sim.run(prompt, [1, 2])
    cache = sim.cache
    # Corrupt the cache: free a cached page behind its back, let another request reuse it.
    node = cache.match(cache.page_keys(prompt)).nodes[2]
    sim.allocator.full.release([node.full_page])
    sim.run(_tokens(41, 64), [1])
    sim.run(prompt + [3, 4, 5], [1])
    assert sim.result.verified_hits == 1 and sim.result.false_hits == 1


def test_lru_heaps_stay_bounded_by_the_tree_under_repeated_hits() -> None:
    sim = _sim()
    prompt = _tokens(60, 30)
    sim.run(prompt, [1, 2])
    cache = sim.cache
    keys = cache.page_keys(prompt)
    for _ in range(5000):  # every hit touches the path: a push per node each time
        cache.match(keys)
    assert len(cache._full_heap) <= 2 * cache.num_nodes + 1024
    assert len(cache._swa_heap) <= 2 * cache.num_nodes + 1024
    # Compaction dropped nothing eviction needs: everything still goes.
    _assert_clean(sim)


def test_a_preempted_request_resumes_from_its_cached_prefix() -> None:
    sim = _sim()
    scheduler = sim.scheduler
    from llm_core.sched.scheduler import Sequence

    seq = Sequence(0, _tokens(70, 30), 8, sim.allocator.new_view())
    scheduler.add(seq)
    while seq.num_computed < 30:
        scheduler.advance(scheduler.schedule())
    seq.output.extend(_tokens(71, 12))  # twelve more tokens, computed in the next step
    scheduler.advance(scheduler.schedule())
    assert seq.num_computed == 42
    scheduler.preempt(seq)
    assert seq.num_computed == 0 and scheduler.waiting.first() is seq
    chunks = scheduler.schedule()
    # Back from the cache: what was computed, up to the last page before the
    # newest token (which must run to give the next logits), is not recomputed;
    # the prompt's own checkpoint alone would give 28.
    assert chunks[0].start == 40
    scheduler.finish(seq, "abort")
    _assert_clean(sim)
