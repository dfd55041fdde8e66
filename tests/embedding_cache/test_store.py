"""SharedEmbeddingStore: round trips, LRU eviction, block accounting, and no torn
reads across processes and threads."""

from __future__ import annotations

import fcntl
import hashlib
import math
import multiprocessing as mp
import os
import random
import statistics
import threading
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import _posixshmem
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedding_cache import DTYPE_NAMES, SharedEmbeddingStore, StoreLayoutError
from embedding_cache.store_lock import lock_file_path

SPAWN = mp.get_context("spawn")
# Races show only where processes really overlap; with the reader or writer lock
# removed, 4 x 5000 ops failed 5 runs out of 5 (4 x 400 ops: 0 out of 2).
HAMMER_OPS = 5000
PROCESS_TIMEOUT_S = 60


def key_of(index: int) -> bytes:
    return hashlib.blake2b(b"test-key-%d" % index, digest_size=32).digest()


def unique_name() -> str:
    return f"swallow-test-{uuid.uuid4().hex[:12]}"


def remove_store(name: str) -> None:
    """Unlink ``name`` if it exists (cleanup for stores other processes created)."""
    try:
        store = SharedEmbeddingStore.attach(name)
    except FileNotFoundError:
        return
    store.close()
    store.unlink()


@pytest.fixture
def make_store() -> Iterator[Callable[..., SharedEmbeddingStore]]:
    created: list[SharedEmbeddingStore] = []

    def make(capacity_bytes: int, **kwargs: Any) -> SharedEmbeddingStore:
        store = SharedEmbeddingStore.create(unique_name(), capacity_bytes, **kwargs)
        created.append(store)
        return store

    yield make
    for store in created:
        store.close()
        store.unlink()


def blocks_free(store: SharedEmbeddingStore) -> int:
    return (store.capacity_bytes - store.used_bytes) // store.block_size


# ---------------------------------------------------------------------- values whose content proves their origin

# Keys of the concurrency tests map to a fixed dtype and length; the content is a
# pattern of (key, nonce) with the nonce as element 0, so any read can be checked
# alone: a torn read (blocks of two writes, or of another key) breaks the pattern.
_PATTERN_DTYPES = (torch.int64, torch.int32, torch.float32, torch.int16)


def patterned_value(index: int, nonce: int) -> torch.Tensor:
    length = 8 + (index * 397) % 2000
    dtype = _PATTERN_DTYPES[index % len(_PATTERN_DTYPES)]
    values = (torch.arange(length, dtype=torch.int64) * (index + 7) + nonce * 13) % 30011
    values[0] = nonce
    return values.to(dtype)


def check_patterned(index: int, value: torch.Tensor) -> str | None:
    """None if ``value`` is exactly some write of key ``index``, else what is wrong."""
    nonce = int(value.reshape(-1)[0]) if value.numel() else -1
    expected = patterned_value(index, nonce)
    if value.dtype != expected.dtype or value.shape != expected.shape or not torch.equal(value, expected):
        return f"key {index}: torn or foreign value (nonce {nonce}, shape {tuple(value.shape)}, {value.dtype})"
    return None


def hammer(store: SharedEmbeddingStore, seed: int, n_ops: int, n_keys: int) -> tuple[list[str], int]:
    """Random put/get/delete on a shared key set; returns (problems, hits)."""
    rng = random.Random(seed)
    problems: list[str] = []
    hits = 0
    for _ in range(n_ops):
        index = rng.randrange(n_keys)
        roll = rng.random()
        if roll < 0.45:
            if not store.put(key_of(index), patterned_value(index, rng.randrange(1, 30000))):
                problems.append(f"put of key {index} refused")
        elif roll < 0.95:
            value = store.get(key_of(index))
            if value is not None:
                hits += 1
                problem = check_patterned(index, value)
                if problem:
                    problems.append(problem)
        else:
            store.delete(key_of(index))
    return problems, hits


# ---------------------------------------------------------------------- child processes (spawned: module level)


def _report(results: Any, target: Callable[..., Any], *args: Any) -> None:
    try:
        results.put(("ok", target(*args)))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def run_in_processes(target: Callable[..., Any], arg_lists: list[tuple]) -> list[Any]:
    """Run ``target(*args)`` in one spawned process per args; their return values, in
    completion order. Fails the test on any exception or abnormal exit."""
    results = SPAWN.Queue()
    processes = [SPAWN.Process(target=_report, args=(results, target, *args)) for args in arg_lists]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=PROCESS_TIMEOUT_S) for _ in processes]
    for process in processes:
        process.join(PROCESS_TIMEOUT_S)
    errors = [detail for status, detail in outcomes if status != "ok"]
    assert not errors, "\n".join(errors)
    assert all(process.exitcode == 0 for process in processes)
    return [detail for _, detail in outcomes]


def _child_reads_then_writes(name: str) -> int:
    store = SharedEmbeddingStore.attach(name)
    try:
        seen = store.get(key_of(1))
        expected = torch.Generator().manual_seed(1)
        assert seen is not None and torch.equal(seen, torch.randn(300, 257, generator=expected))
        assert store.put(key_of(2), torch.arange(70_000, dtype=torch.int64).reshape(7, 10_000))
        return store.stats()["hits"]
    finally:
        store.close()


def _child_hammers(name: str, capacity: int, seed: int, barrier: Any) -> tuple[list[str], int, int]:
    barrier.wait()  # all open() at once: the create-or-attach race is part of the test
    store = SharedEmbeddingStore.open(name, capacity, block_size=256)
    try:
        problems, hits = hammer(store, seed, n_ops=HAMMER_OPS, n_keys=24)
        return problems, hits, store.stats()["puts"]
    finally:
        store.close()


def _child_dies_mid_put(name: str) -> None:
    store = SharedEmbeddingStore.attach(name)

    def die(*args: Any) -> None:
        os._exit(0)  # after the blocks are taken and written, before the slot is published

    store._tables.publish = die  # type: ignore[method-assign]
    store.put(key_of(99), torch.ones(300))  # 5 blocks: fits without evicting


# ---------------------------------------------------------------------- round trips


SHAPES = [(), (0,), (1,), (5,), (3, 0, 2), (4, 7), (2, 3, 4), (2, 1, 3, 2, 2, 3)]


@pytest.mark.parametrize("dtype", [getattr(torch, name) for name in DTYPE_NAMES], ids=str)
def test_round_trip_every_dtype_and_shape(make_store: Callable[..., SharedEmbeddingStore], dtype: torch.dtype) -> None:
    store = make_store(64 * 1024, block_size=256)
    generator = torch.Generator().manual_seed(0)
    for index, shape in enumerate(SHAPES):
        if dtype.is_floating_point:
            value = (torch.randn(shape, generator=generator) * 100).to(dtype)
        elif dtype == torch.bool:
            value = torch.randint(0, 2, shape, generator=generator).bool()
        else:
            info = torch.iinfo(dtype)
            value = torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)
        assert store.put(key_of(index), value)
        got = store.get(key_of(index))
        assert got is not None and got.dtype == dtype and got.shape == value.shape
        assert torch.equal(got, value)
    store._check_invariants()


def test_rejects_bad_values_and_keys(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(64 * 1024, block_size=256)
    with pytest.raises(ValueError):
        store.put(key_of(0), torch.zeros((1,) * 7))
    with pytest.raises(TypeError):
        store.put(key_of(0), torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError):
        store.put(b"short", torch.zeros(3))
    with pytest.raises(ValueError):
        store.get(b"short")
    assert b"short" not in store and len(store) == 0


def test_non_contiguous_values_are_stored_by_their_elements(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(64 * 1024, block_size=256)
    value = torch.arange(60, dtype=torch.float32).reshape(6, 10)[:, ::3].t()
    assert store.put(key_of(0), value)
    assert torch.equal(store.get(key_of(0)), value)


def test_values_spanning_many_fragmented_blocks(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(64 * 256, block_size=256)
    # Fill, then free every other entry, so the next values get non-consecutive chains.
    for index in range(64):
        assert store.put(key_of(index), torch.full((64,), index, dtype=torch.int32))
    for index in range(0, 64, 2):
        assert store.delete(key_of(index))
    assert blocks_free(store) == 32
    sizes = [1, 255, 256, 257, 1000, 4097]  # bytes: below, at and across block boundaries
    values = {100 + i: torch.randint(0, 256, (size,), dtype=torch.uint8) for i, size in enumerate(sizes)}
    for index, value in values.items():
        assert store.put(key_of(index), value)
    for index, value in values.items():
        assert torch.equal(store.get(key_of(index)), value)
    assert store.used_bytes <= store.capacity_bytes
    store._check_invariants()


def test_get_returns_a_private_copy(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(4 * 256, block_size=256)
    value = torch.arange(64, dtype=torch.float32)
    store.put(key_of(0), value)
    got = store.get(key_of(0))
    got += 1
    assert torch.equal(store.get(key_of(0)), value)
    # The blocks are reused by the next value; the tensor already returned is unaffected.
    store.delete(key_of(0))
    store.put(key_of(1), torch.zeros(256))
    assert torch.equal(got, value + 1)


def test_overwrite_replaces_value_and_frees_the_old_blocks(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(16 * 256, block_size=256)
    assert store.put(key_of(0), torch.zeros(640, dtype=torch.uint8))  # 3 blocks
    assert store.put(key_of(0), torch.ones(2, 3, dtype=torch.int64))  # 1 block
    got = store.get(key_of(0))
    assert torch.equal(got, torch.ones(2, 3, dtype=torch.int64))
    assert len(store) == 1 and store.used_bytes == 256 and store.stats()["evictions"] == 0
    store._check_invariants()


# ---------------------------------------------------------------------- eviction


def test_eviction_is_least_recently_used(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(8 * 256, block_size=256)
    one_block = torch.zeros(64, dtype=torch.float32)
    for index in range(8):
        assert store.put(key_of(index), one_block + index)
    for index in (0, 1, 2, 3):  # touched: now more recent than 4..7
        assert store.get(key_of(index)) is not None
    for index in range(8, 12):
        assert store.put(key_of(index), one_block + index)
        assert store.used_bytes <= store.capacity_bytes
    assert [index for index in range(12) if key_of(index) in store] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert store.stats()["evictions"] == 4
    # A 3-block value evicts the three least recent one-block entries: 0, 1, 2.
    assert store.put(key_of(20), torch.zeros(3 * 64))
    assert [index for index in range(12) if key_of(index) in store] == [3, 8, 9, 10, 11]
    assert store.stats()["evictions"] == 7 and store.used_bytes == store.capacity_bytes
    store._check_invariants()


def test_max_entries_bounds_the_index(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(64 * 256, block_size=256, max_entries=3)
    for index in range(5):
        store.put(key_of(index), torch.zeros(4))
    assert len(store) == 3 and [index for index in range(5) if key_of(index) in store] == [2, 3, 4]
    assert store.stats()["evictions"] == 2
    store._check_invariants()


def test_value_larger_than_capacity_is_refused_without_evicting(
    make_store: Callable[..., SharedEmbeddingStore],
) -> None:
    store = make_store(8 * 256, block_size=256)
    for index in range(4):
        store.put(key_of(index), torch.zeros(64))
    assert store.put(key_of(10), torch.zeros(8 * 64)) is True  # exactly the capacity fits
    for index in range(4):
        store.put(key_of(index), torch.zeros(64))
    assert store.put(key_of(11), torch.zeros(8 * 64 + 1)) is False
    assert len(store) == 4 and key_of(11) not in store
    assert store.stats()["evictions"] == 5  # 4 for the full-size value, 1 when refilling
    store._check_invariants()


def test_delete_and_clear_return_every_block(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(32 * 256, block_size=256)
    for index in range(10):
        store.put(key_of(index), torch.zeros(index * 20 + 1))
    assert store.delete(key_of(3)) and not store.delete(key_of(3)) and key_of(3) not in store
    for index in range(10):
        store.delete(key_of(index))
    assert len(store) == 0 and store.used_bytes == 0 and blocks_free(store) == 32
    store._check_invariants()
    for index in range(10):
        store.put(key_of(index), torch.zeros(index * 20 + 1))
    store.clear()
    assert len(store) == 0 and store.used_bytes == 0 and store.get(key_of(1)) is None
    store._check_invariants()
    assert store.put(key_of(1), torch.zeros(32 * 64))  # the whole capacity is usable again


def test_stats_count_hits_misses_puts(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(8 * 256, block_size=256)
    store.put(key_of(0), torch.zeros(3))
    store.get(key_of(0))
    store.get(key_of(1))
    stats = store.stats()
    assert stats == {
        "entries": 1,
        "used_bytes": 256,
        "capacity_bytes": 2048,
        "evictions": 0,
        "hits": 1,
        "misses": 1,
        "puts": 1,
    }


def test_deletion_keeps_every_key_reachable(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    # 48 entries in 128 slots: long probe runs, some wrapping past the table's end,
    # so backward-shift deletion moves entries on nearly every delete.
    store = make_store(48 * 64, block_size=64)
    rng = random.Random(0)
    live: set[int] = set()
    for round_ in range(6):
        for index in range(round_ * 100, round_ * 100 + 48 - len(live)):
            store.put(key_of(index), torch.tensor([index]))
            live.add(index)
        for index in rng.sample(sorted(live), 30):
            assert store.delete(key_of(index))
            live.remove(index)
            store._check_invariants()
            assert all(torch.equal(store.get(key_of(i)), torch.tensor([i])) for i in live)
    assert store.stats()["evictions"] == 0


# ---------------------------------------------------------------------- randomized, against a model


class LruModel:
    """What the store must hold: an ordered dict in recency order plus block accounting."""

    def __init__(self, n_blocks: int, block_size: int, max_entries: int) -> None:
        self.entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.max_entries = max_entries
        self.evictions = 0

    def blocks_of(self, value: torch.Tensor) -> int:
        return max(1, math.ceil(value.numel() * value.element_size() / self.block_size))

    def used_blocks(self) -> int:
        return sum(self.blocks_of(value) for value in self.entries.values())

    def put(self, index: int, value: torch.Tensor) -> bool:
        if self.blocks_of(value) > self.n_blocks:
            return False
        self.entries.pop(index, None)
        while (
            self.n_blocks - self.used_blocks() < self.blocks_of(value) or len(self.entries) >= self.max_entries
        ):
            self.entries.popitem(last=False)
            self.evictions += 1
        self.entries[index] = value
        return True

    def get(self, index: int) -> torch.Tensor | None:
        if index not in self.entries:
            return None
        self.entries.move_to_end(index)
        return self.entries[index]


# Mostly 1-2 block values, so several entries coexist and gets reorder them before
# evictions; sometimes up to 11 blocks (over the 8-block capacity: refused). Clears
# are rare: each one wipes the history the other operations built.
VALUE_BYTES = st.one_of(st.integers(0, 130), st.integers(0, 130), st.integers(0, 700))
OPERATION_NAMES = st.sampled_from(("put",) * 8 + ("get",) * 8 + ("delete",) * 2 + ("clear",))
OPERATIONS = st.lists(st.tuples(OPERATION_NAMES, st.integers(0, 9), VALUE_BYTES), min_size=10, max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=OPERATIONS)
def test_matches_an_lru_model(operations: list[tuple[str, int, int]]) -> None:
    block_size, n_blocks, max_entries = 64, 8, 6
    store = SharedEmbeddingStore.create(unique_name(), n_blocks * block_size, block_size=64, max_entries=max_entries)
    model = LruModel(n_blocks, block_size, max_entries)
    try:
        for step, (operation, index, size) in enumerate(operations):
            if operation == "put":
                value = torch.full((size,), step % 256, dtype=torch.uint8)
                assert store.put(key_of(index), value) == model.put(index, value)
            elif operation == "get":
                got, expected = store.get(key_of(index)), model.get(index)
                assert (got is None) == (expected is None)
                assert got is None or torch.equal(got, expected)
            elif operation == "delete":
                assert store.delete(key_of(index)) == (model.entries.pop(index, None) is not None)
            else:
                store.clear()
                model.entries.clear()
            assert {i for i in range(10) if key_of(i) in store} == set(model.entries)
            assert store.used_bytes == model.used_blocks() * block_size <= store.capacity_bytes
            assert store.stats()["evictions"] == model.evictions
        store._check_invariants()
    finally:
        store.close()
        store.unlink()


# ---------------------------------------------------------------------- naming, attach, lifecycle


def test_attach_to_a_missing_store_is_a_clear_error() -> None:
    name = unique_name()
    with pytest.raises(FileNotFoundError, match=name):
        SharedEmbeddingStore.attach(name)
    assert not os.path.exists(lock_file_path(name))


def test_attach_to_a_foreign_segment_is_refused() -> None:
    name = unique_name()
    foreign = SharedMemory(name, create=True, size=8192)
    resource_tracker.unregister(foreign._name, "shared_memory")
    try:
        foreign.buf[:8] = b"NOTSTORE"
        with pytest.raises(StoreLayoutError, match="not an embedding store"):
            SharedEmbeddingStore.attach(name)
    finally:
        foreign.close()
        _posixshmem.shm_unlink(foreign._name)
        if os.path.exists(lock_file_path(name)):
            os.unlink(lock_file_path(name))


def test_create_open_attach_share_one_segment(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(16 * 256, block_size=256)
    with pytest.raises(FileExistsError):
        SharedEmbeddingStore.create(store.name, 4096, block_size=256)
    store.put(key_of(0), torch.arange(5))
    # open() of an existing store attaches to it and keeps its geometry.
    with SharedEmbeddingStore.open(store.name, 1 << 20, block_size=1024) as reopened:
        assert reopened.capacity_bytes == 16 * 256 and reopened.block_size == 256
        assert torch.equal(reopened.get(key_of(0)), torch.arange(5))
        reopened.put(key_of(1), torch.arange(6))
    assert torch.equal(store.get(key_of(1)), torch.arange(6))
    with pytest.raises(ValueError, match="closed"):
        reopened.get(key_of(0))


def test_open_creates_when_missing() -> None:
    name = unique_name()
    store = SharedEmbeddingStore.open(name, 4 * 256, block_size=256)
    try:
        assert store.capacity_bytes == 1024 and len(store) == 0
    finally:
        store.close()
        store.unlink()
    assert not os.path.exists(lock_file_path(name))
    with pytest.raises(FileNotFoundError):
        SharedEmbeddingStore.attach(name)


# ---------------------------------------------------------------------- processes and threads


def test_second_process_reads_and_writes(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(1 << 20, block_size=4096)
    value = torch.randn(300, 257, generator=torch.Generator().manual_seed(1))
    store.put(key_of(1), value)
    [child_hits] = run_in_processes(_child_reads_then_writes, [(store.name,)])
    assert child_hits == 1
    assert torch.equal(store.get(key_of(2)), torch.arange(70_000, dtype=torch.int64).reshape(7, 10_000))
    # The child exited: with the resource tracker bypassed, the segment survives it.
    assert torch.equal(store.get(key_of(1)), value)


def test_concurrent_processes_never_see_torn_values() -> None:
    name = unique_name()
    capacity = 256 * 256  # a quarter of what 24 keys of 1..63 blocks need: constant eviction
    barrier = SPAWN.Barrier(4)
    try:
        outcomes = run_in_processes(_child_hammers, [(name, capacity, seed, barrier) for seed in range(4)])
        problems = [problem for worker_problems, _, _ in outcomes for problem in worker_problems]
        assert not problems, problems[:10]
        assert sum(hits for _, hits, _ in outcomes) > 100
        with SharedEmbeddingStore.attach(name) as store:
            store._check_invariants()
            stats = store.stats()
            assert stats["evictions"] > 50 and stats["used_bytes"] <= capacity
    finally:
        remove_store(name)


@pytest.mark.parametrize("instances", [1, 2])
def test_threads_never_see_torn_values(instances: int) -> None:
    first = SharedEmbeddingStore.create(unique_name(), 256 * 256, block_size=256)
    stores = [first] + [SharedEmbeddingStore.attach(first.name) for _ in range(instances - 1)]
    outcomes: list[tuple[list[str], int]] = []

    def work(seed: int) -> None:
        outcomes.append(hammer(stores[seed % instances], seed, n_ops=500, n_keys=24))

    try:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(outcomes) == 4
        problems = [problem for worker_problems, _ in outcomes for problem in worker_problems]
        assert not problems, problems[:10]
        first._check_invariants()
    finally:
        for store in stores:
            store.close()
        first.unlink()


def test_lock_excludes_other_processes(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    # flock treats another open file description like another process, so a second
    # descriptor in this process stands in for a writer / reader elsewhere.
    store = make_store(16 * 256, block_size=256)
    store.put(key_of(0), torch.arange(10))
    other = os.open(lock_file_path(store.name), os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_EX)  # a writer elsewhere, mid-put
        reader = _in_thread(lambda: store.get(key_of(0)))
        assert not reader.wait(0.2)
        fcntl.flock(other, fcntl.LOCK_UN)
        assert reader.wait(10)
        fcntl.flock(other, fcntl.LOCK_SH)  # a reader elsewhere, mid-copy
        assert _in_thread(lambda: len(store)).wait(10)  # readers share
        writer = _in_thread(lambda: store.put(key_of(1), torch.arange(3)))
        assert not writer.wait(0.2)
        fcntl.flock(other, fcntl.LOCK_UN)
        assert writer.wait(10) and key_of(1) in store
    finally:
        os.close(other)


def _in_thread(action: Callable[[], object]) -> threading.Event:
    done = threading.Event()

    def run() -> None:
        action()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def test_a_writer_dying_mid_put_is_repaired(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(32 * 256, block_size=256)
    for index in range(5):
        store.put(key_of(index), torch.full((100,), index))
    used_before = store.used_bytes
    _spawn_and_wait(_child_dies_mid_put, store.name)
    # The child took blocks and died holding them: readers see misses, not garbage...
    assert store.used_bytes == used_before + 5 * 256
    assert store.get(key_of(0)) is None
    # ...until the next writer rebuilds the index and reclaims the leaked blocks.
    assert store.put(key_of(5), torch.zeros(3))
    store._check_invariants()
    assert store.used_bytes == used_before + 256
    for index in range(5):
        assert torch.equal(store.get(key_of(index)), torch.full((100,), index))


def test_an_instance_inherited_across_fork_takes_its_own_lock(
    make_store: Callable[..., SharedEmbeddingStore],
) -> None:
    store = make_store(16 * 256, block_size=256)
    inherited_fd = store._lock_fd
    pid = os.fork()
    if pid == 0:
        exit_code = 1
        try:
            stored = store.put(key_of(3), torch.arange(4))
            exit_code = 0 if stored and store._lock_fd != inherited_fd else 2
        finally:
            os._exit(exit_code)  # no pytest teardown, no unlink in the child
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(store.get(key_of(3)), torch.arange(4)) and store._lock_fd == inherited_fd


def _spawn_and_wait(target: Callable[..., Any], *args: Any) -> None:
    process = SPAWN.Process(target=target, args=args)
    process.start()
    process.join(PROCESS_TIMEOUT_S)
    assert process.exitcode == 0


# ---------------------------------------------------------------------- speed


def test_get_of_1mb_is_fast(make_store: Callable[..., SharedEmbeddingStore]) -> None:
    store = make_store(8 << 20)
    value = torch.randn(256, 1024)  # 1 MiB of float32
    store.put(key_of(0), value)
    assert torch.equal(store.get(key_of(0)), value)
    timings = []
    for _ in range(50):
        start = time.perf_counter()
        store.get(key_of(0))
        timings.append(time.perf_counter() - start)
    # Typically ~0.05-0.1 ms here; 2 ms leaves room for a loaded machine.
    assert statistics.median(timings) < 2e-3, statistics.median(timings)


def test_stored_dtypes_keep_torch_names_and_sizes() -> None:
    # The segment's table is torch-free (a supervisor reads it): it must say what torch says.
    from embedding_cache.store_segment import ITEMSIZES, NAMES_BY_CODE

    for name, code in DTYPE_NAMES.items():
        assert NAMES_BY_CODE[code] == name and ITEMSIZES[code] == getattr(torch, name).itemsize
