"""Host and disk KV tiers under the radix cache: addresses, LRU budgets,
demotion, spilling, restores, corrupted entries (bookkeeping, no model)."""

from __future__ import annotations

import random

from llm_core.sched.cache_sim import CacheSimulator
from llm_core.kv.tiers.kv_tiers import FULL, SWA, KVTiers, TierConfig
from llm_core.kv.page_address import model_fingerprint, page_address, token_bytes

PAGE, WINDOW = 4, 9  # W = 8 tokens: a checkpoint window spans 2 pages


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _sim(full: int = 64, host: int = 0, disk: int = 0, **kwargs) -> CacheSimulator:
    return CacheSimulator(PAGE, WINDOW, full, 64, chunk=16, verify=True, host_tokens=host, disk_tokens=disk,
                          **kwargs)


def _crowd_out(sim: CacheSimulator, seed: int, requests: int = 12) -> None:
    """Other users' requests, enough to push everything else off the device."""
    for i in range(requests):
        sim.run(_tokens(seed + i, 30), _tokens(seed + 100 + i, 2))


def test_page_addresses_chain_every_page_before_and_the_model() -> None:
    a, b = model_fingerprint("config-a", "weights", "bf16"), model_fingerprint("config-b", "weights", "bf16")
    page1, page2 = token_bytes((1, 2, 3, 4)), token_bytes((5, 6, 7, 8))
    assert page_address(a, page1) == page_address(a, page1)  # the same in every process
    assert page_address(a, page1) != page_address(b, page1)  # another model never reads it
    # The same page tokens after a different first page: a different address.
    assert page_address(page_address(a, page1), page2) != page_address(page_address(a, page2), page2)
    # Multimodal cache tokens are negative ids and hash as such.
    assert page_address(a, token_bytes((-5, 2, 3, 4))) != page_address(a, token_bytes((5, 2, 3, 4)))


def test_host_tier_spills_its_least_recently_used_entries_to_disk_and_disk_drops_them() -> None:
    tiers = KVTiers(TierConfig(host_bytes=2 * 16, disk_bytes=3 * 16, full_page_bytes=16, swa_token_bytes=4))
    pages = [bytes([i]) * 16 for i in range(6)]
    for i, address in enumerate(pages[:3]):
        tiers.demote_full(address, page=i)
    assert list(tiers.host.keys()) == [pages[1] + FULL, pages[2] + FULL]
    assert list(tiers.disk.keys()) == [pages[0] + FULL]
    tiers.touch_page(pages[1])  # a match will read it: the other one spills next
    for i, address in enumerate(pages[3:], 3):
        tiers.demote_full(address, page=i)
    assert list(tiers.host.keys()) == [pages[4] + FULL, pages[5] + FULL]
    assert list(tiers.disk.keys()) == [pages[2] + FULL, pages[1] + FULL, pages[3] + FULL]
    assert tiers.stats.dropped_entries == 1 and tiers.full_tier(pages[0]) is None
    assert tiers.host.used_bytes == 32 and tiers.disk.used_bytes == 48
    # Demoting a page a tier already holds copies nothing.
    before = tiers.stats.demoted_bytes
    tiers.demote_full(pages[2], page=9)
    assert tiers.stats.demoted_bytes == before


def test_a_longer_swa_window_replaces_a_shorter_one_and_a_shorter_one_is_not_stored() -> None:
    tiers = KVTiers(TierConfig(host_bytes=1000, disk_bytes=0, full_page_bytes=16, swa_token_bytes=4))
    address = b"a" * 16
    tiers.demote_swa(address, [1, 2])
    tiers.demote_swa(address, [3, 4, 5, 6])
    assert tiers.swa_tokens(address) == 4 and tiers.host.used_bytes == 16
    tiers.demote_swa(address, [7])
    assert tiers.swa_tokens(address) == 4 and tiers.host.tokens(address + SWA) == 4


def test_a_conversation_pushed_off_the_device_comes_back_from_host_memory() -> None:
    prompt, answer = _tokens(1, 26), _tokens(2, 6)
    turn2 = prompt + answer + _tokens(3, 5)
    hits = {}
    for host in (0, 2000):
        sim = _sim(host=host)
        sim.run(prompt, answer)
        _crowd_out(sim, 50)
        hits[host] = sim.run(turn2, [1])
        assert sim.result.false_hits == 0 and sim.result.verified_hits == int(host > 0)
    assert hits[0] == 0  # the device alone forgot it
    assert hits[2000] == 32  # every page of the first turn, from host memory
    assert sim.result.cached_tokens_by_tier["host"] >= 32


def test_a_small_host_tier_spills_to_disk_and_the_disk_serves_the_hit() -> None:
    prompt, answer = _tokens(1, 26), _tokens(2, 6)
    sim = _sim(host=24, disk=2000)
    sim.run(prompt, answer)
    _crowd_out(sim, 50, requests=20)
    assert sim.run(prompt + answer + _tokens(3, 5), [1]) == 32
    assert sim.result.cached_tokens_by_tier["disk"] > 0
    assert sim.result.false_hits == 0
    assert sim.tiers is not None and sim.tiers.stats.spilled_bytes > 0


def test_a_corrupted_page_is_a_miss_from_that_page_on() -> None:
    prompt, answer = _tokens(1, 26), _tokens(2, 6)
    sim = _sim(host=2000)
    sim.run(prompt, answer)
    _crowd_out(sim, 50)
    tiers = sim.tiers
    assert tiers is not None
    keys = sim.cache.page_keys(prompt + answer)
    address = sim.cache.root.address
    for key in keys[:5]:  # the sixth page
        address = page_address(address, sim.cache.key_bytes(key))
    tiers.io.corrupt("host", address + FULL)  # type: ignore[union-attr]
    hit = sim.run(prompt + answer + _tokens(3, 5), [1])
    assert hit < 32  # not the corrupted page, nor anything after it
    assert tiers.stats.load_failures == 1
    assert sim.result.false_hits == 0
    assert address + FULL not in tiers.host  # forgotten: the next match stops before it


def test_peek_reports_cached_length_per_tier_and_changes_nothing() -> None:
    prompt, answer = _tokens(1, 26), _tokens(2, 6)
    sim = _sim(host=2000)
    sim.run(prompt, answer)
    keys = sim.cache.page_keys(prompt + answer + [7])
    assert sim.cache.peek(keys).device == 32
    _crowd_out(sim, 50)
    tiers = sim.tiers
    assert tiers is not None
    order = list(tiers.host.keys())
    stamps = [(n.stamp, n.swa_stamp) for n in sim.cache.root.children.values()]
    lengths = sim.cache.peek(keys)
    assert (lengths.device, lengths.host, lengths.disk) == (0, 32, 32)
    assert list(tiers.host.keys()) == order
    assert [(n.stamp, n.swa_stamp) for n in sim.cache.root.children.values()] == stamps
    assert tiers.stats.restored_entries["host"] == 0


def test_a_restore_without_room_on_the_device_keeps_the_device_part_only() -> None:
    prompt, answer = _tokens(1, 26), _tokens(2, 6)
    sim = _sim(full=64, host=2000)
    sim.run(prompt, answer)
    _crowd_out(sim, 50)
    cache, alloc = sim.cache, sim.allocator
    cache.flush()  # everything to host memory, then running requests hold the whole device pool
    views = []
    while alloc.full.free_pages:
        view = alloc.new_view()
        alloc.grow(view, PAGE)
        views.append(view)
    view = alloc.new_view()
    lock = cache.attach(view, cache.match(cache.page_keys(prompt + answer + [1])))
    assert lock is not None and view.num_tokens == 0  # no room: no hit, nothing broken
    cache.release(lock)
    for v in views:
        alloc.free(v)
    cache.flush()
    assert alloc.full.free_slots == alloc.full.capacity and alloc.swa.free_slots == alloc.swa.capacity
