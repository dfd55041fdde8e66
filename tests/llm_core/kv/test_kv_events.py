"""KV events: a router's index rebuilt from them sees exactly the window-safe
prefixes the worker's own cache would match, on every tier."""

from __future__ import annotations

import random

import pytest

from llm_core.sched.cache_sim import CacheSimulator
from llm_core.kv.kv_events import EventBatch, KVEvent, KVEventLog
from llm_core.kv.tiers.kv_tiers import FULL, SWA
from llm_core.kv.page_address import token_page_addresses
from llm_core.cluster.router import PrefixIndex

PAGE = 4
WINDOW = 6  # W = 5 tokens: a window spans two pages


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts sharing prefixes of several lengths (documents, then turns)."""
    documents = [[rng.randrange(1, 50) for _ in range(rng.randrange(8, 40))] for _ in range(5)]
    out = []
    for _ in range(n):
        doc = rng.choice(documents)
        cut = rng.randrange(len(doc) // 2, len(doc) + 1)
        out.append(doc[:cut] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))])
    return out


def _simulator(events: KVEventLog, tiers: bool) -> CacheSimulator:
    return CacheSimulator(PAGE, WINDOW, full_tokens=96, swa_tokens=40, chunk=8, checkpoint_interval=12,
                          host_tokens=64 if tiers else 0, disk_tokens=64 if tiers else 0, events=events)


@pytest.mark.parametrize("tiers", [False, True])
def test_index_from_events_matches_the_cache_on_every_tier(tiers: bool) -> None:
    rng = random.Random(7 + tiers)
    log = KVEventLog()
    sim = _simulator(log, tiers)
    index = PrefixIndex(sim.cache.geometry())
    prompts = _prompts(rng, 120)
    checked = reused = 0
    for prompt in prompts:
        sim.run(prompt, [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))])
        assert index.apply(log.drain())
        for probe in rng.sample(prompts, 8):
            limit = (len(probe) - 1) // PAGE
            lengths = sim.cache.peek(sim.cache.page_keys(probe), max_pages=limit)
            addresses = token_page_addresses(index.geometry, probe, limit)
            assert index.reusable_tokens(addresses, ("device",)) == lengths.device
            assert index.reusable_tokens(addresses, ("device", "host")) == lengths.host
            assert index.reusable_tokens(addresses) == lengths.disk
            checked += 1
            reused += lengths.disk > 0
    assert checked and reused > checked // 10, "the workload should hit often enough to test something"
    if tiers:
        assert sim.tiers is not None and sim.tiers.stats.demoted_bytes and sim.tiers.stats.spilled_bytes


def test_flush_empties_the_index() -> None:
    log = KVEventLog()
    sim = _simulator(log, tiers=False)
    for prompt in _prompts(random.Random(1), 10):
        sim.run(prompt, [1, 2])
    index = PrefixIndex(sim.cache.geometry())
    index.apply(log.drain())
    assert len(index) > 0
    sim.cache.flush()
    index.apply(log.drain())
    assert len(index) == 0 and len(log) == 0


def test_a_snapshot_then_later_batches_equal_the_whole_history() -> None:
    rng = random.Random(3)
    log = KVEventLog()
    sim = _simulator(log, tiers=True)
    prompts = _prompts(rng, 60)
    whole = PrefixIndex(sim.cache.geometry())
    late = PrefixIndex(sim.cache.geometry())
    for i, prompt in enumerate(prompts):
        sim.run(prompt, [5])
        if i == 20:
            # Joins with events still undrained: the snapshot covers them, and
            # the batch that drains them next (starting before it) is still taken.
            assert late.apply(log.snapshot())
        batch = log.drain()
        assert whole.apply(batch)
        if i >= 20:
            assert late.apply(batch)
    for probe in prompts:
        addresses = token_page_addresses(whole.geometry, probe)
        assert late.reusable_tokens(addresses) == whole.reusable_tokens(addresses)


def test_a_gap_asks_for_a_snapshot_and_a_new_epoch_starts_empty() -> None:
    log = KVEventLog()
    address = bytes(16)
    log.record("device", address, FULL, 1)
    log.record("device", address, SWA, 3)
    index = PrefixIndex(_simulator(KVEventLog(), False).cache.geometry())
    assert index.apply(log.drain()) and len(index) == 1
    log.record("host", address, FULL, 1)
    log.drain()  # lost on the way
    log.record("device", address, FULL, 0)
    assert not index.apply(log.drain()), "a batch starting past what the index knows is a gap"
    assert index.apply(log.snapshot())
    assert index.seq == log.seq and len(index) == 1  # host still holds it
    log.reset()
    log.record("disk", b"\x01" * 16, FULL, 1)
    assert index.apply(log.drain()) and index.epoch == log.epoch
    assert len(index) == 1  # the old epoch's pages are gone


def test_unchanged_state_records_nothing() -> None:
    log = KVEventLog()
    log.record("device", bytes(16), FULL, 1)
    log.record("device", bytes(16), FULL, 1)
    log.record("host", bytes(16), SWA, 0)  # nothing to remove
    batch = log.drain()
    assert batch == EventBatch(0, 0, (KVEvent("device", bytes(16), FULL, 1),))
    assert log.drain().events == () and log.seq == 1
