"""Host and disk KV byte stores: round trips, capacity, corruption, restart, races."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from llm_core.kv.tiers import kv_disk_store
from llm_core.kv.tiers.kv_disk_store import DiskEntry, DiskKVStore
from llm_core.kv.tiers.kv_store import HostKVPool

def _fingerprint(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


NS = _fingerprint("model-a")


def _key(i: int, tag: bytes = b"F") -> bytes:
    return i.to_bytes(16, "little") + tag


def _parts(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 5, generator=gen),
        # Odd element count: the int64 part after it starts at an unaligned byte offset.
        torch.randn(7, generator=gen).to(torch.bfloat16),
        torch.randint(-(2**62), 2**62, (2, 3), generator=gen, dtype=torch.int64),
    ]


def _nbytes(parts: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in parts)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _kv_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- host


def test_host_round_trip_is_bit_exact_across_dtypes_and_shapes() -> None:
    pool = HostKVPool(1 << 20)
    parts = _parts(0)
    pool.put(_key(1), parts, tokens=16)
    outs = [torch.empty_like(p) for p in parts]
    assert pool.get_into(_key(1), outs) is True
    for out, part in zip(outs, parts, strict=True):
        assert _same_bits(out, part)
    assert pool.tokens(_key(1)) == 16
    assert pool.used_bytes == _nbytes(parts) == 60 + 14 + 48
    assert len(pool) == 1 and _key(1) in pool and pool.keys() == [_key(1)]


def test_host_put_copies_and_outs_may_be_non_contiguous() -> None:
    pool = HostKVPool(1 << 20)
    parts = _parts(1)
    originals = [p.clone() for p in parts]
    pool.put(_key(1), parts, tokens=3)
    for p in parts:
        p.zero_()  # the pool holds its own copy
    outs = [torch.empty(5, 3).t(), torch.empty(7, dtype=torch.bfloat16), torch.empty(3, 2, dtype=torch.int64).t()]
    assert not outs[0].is_contiguous() and not outs[2].is_contiguous()
    assert pool.get_into(_key(1), outs) is True
    for out, orig in zip(outs, originals, strict=True):
        assert torch.equal(out.contiguous().view(torch.uint8), orig.view(torch.uint8))


def test_host_get_into_reinterprets_bytes_in_put_order() -> None:
    pool = HostKVPool(1024)
    pool.put(_key(1), [torch.arange(4, dtype=torch.int32), torch.tensor(7, dtype=torch.int64)], tokens=1)
    out = torch.empty(24, dtype=torch.uint8)
    assert pool.get_into(_key(1), [out])
    expected = np.concatenate([np.arange(4, dtype=np.int32).view(np.uint8), np.array([7], np.int64).view(np.uint8)])
    assert out.numpy().tolist() == expected.tolist()


def test_host_replace_updates_bytes_tokens_and_usage() -> None:
    pool = HostKVPool(1024)
    pool.put(_key(1), [torch.full((10,), 1, dtype=torch.uint8)], tokens=1)
    pool.put(_key(2), [torch.full((4,), 9, dtype=torch.uint8)], tokens=2)
    pool.put(_key(1), [torch.full((30,), 5, dtype=torch.uint8)], tokens=7)
    assert len(pool) == 2 and pool.used_bytes == 34
    assert pool.tokens(_key(1)) == 7
    assert pool.keys() == [_key(2), _key(1)]
    out = torch.empty(30, dtype=torch.uint8)
    assert pool.get_into(_key(1), [out]) and out.tolist() == [5] * 30


def test_host_capacity_errors() -> None:
    pool = HostKVPool(100)
    with pytest.raises(ValueError, match="exceeds"):
        pool.put(_key(1), [torch.zeros(101, dtype=torch.uint8)], tokens=1)
    pool.put(_key(1), [torch.zeros(60, dtype=torch.uint8)], tokens=1)
    with pytest.raises(MemoryError, match="evict"):
        pool.put(_key(2), [torch.zeros(41, dtype=torch.uint8)], tokens=1)
    assert _key(2) not in pool and pool.used_bytes == 60
    # Replacing an entry frees its old bytes first: 100 fits where 60 was.
    pool.put(_key(1), [torch.zeros(100, dtype=torch.uint8)], tokens=1)
    assert pool.used_bytes == 100
    pool.remove(_key(1))
    pool.put(_key(2), [torch.zeros(40, dtype=torch.uint8)], tokens=1)
    assert pool.used_bytes == 40 and pool.capacity_bytes == 100


def test_host_remove_and_missing() -> None:
    pool = HostKVPool(1024)
    pool.put(_key(1), [torch.ones(8)], tokens=2)
    pool.remove(_key(1))
    pool.remove(_key(1))  # no error when missing
    assert _key(1) not in pool and len(pool) == 0 and pool.used_bytes == 0
    out = torch.full((8,), 3.0)
    assert pool.get_into(_key(1), [out]) is False
    assert out.tolist() == [3.0] * 8
    assert pool.get_bytes(_key(1)) is None
    assert pool.checksum_failures == 0
    with pytest.raises(KeyError):
        pool.tokens(_key(1))


def test_host_out_size_mismatch_raises() -> None:
    pool = HostKVPool(1024)
    pool.put(_key(1), [torch.ones(8)], tokens=2)
    with pytest.raises(ValueError, match="32"):
        pool.get_into(_key(1), [torch.empty(7)])
    assert _key(1) in pool


def test_host_corrupted_byte_is_detected_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    pool = HostKVPool(1024)
    parts = _parts(2)
    pool.put(_key(1), parts, tokens=4)
    pool.put(_key(2), parts, tokens=4)
    blob = pool.get_bytes(_key(1))
    assert blob is not None and blob.dtype == torch.uint8 and blob.numel() == _nbytes(parts)
    blob[17] ^= 0x01  # a view: this flips the stored byte
    outs = [torch.zeros_like(p) for p in parts]
    with caplog.at_level(logging.WARNING, logger="llm_core.kv.tiers.kv_store"):
        assert pool.get_into(_key(1), outs) is False
    assert all(not o.any() for o in outs)  # nothing copied
    assert _key(1) not in pool and pool.checksum_failures == 1
    assert pool.used_bytes == _nbytes(parts)
    assert "checksum mismatch" in caplog.text
    # The other entry is untouched.
    assert pool.get_into(_key(2), outs) and all(_same_bits(o, p) for o, p in zip(outs, parts, strict=True))


def test_host_get_bytes_is_a_view_of_the_stored_blob() -> None:
    pool = HostKVPool(1024)
    pool.put(_key(1), [torch.arange(6, dtype=torch.int16)], tokens=1)
    a, b = pool.get_bytes(_key(1)), pool.get_bytes(_key(1))
    assert a is not None and b is not None
    assert a.data_ptr() == b.data_ptr()
    assert a.view(torch.int16).tolist() == list(range(6))


def test_host_rejects_bad_keys() -> None:
    pool = HostKVPool(1024)
    with pytest.raises(ValueError):
        pool.put(b"", [torch.ones(1)], tokens=1)
    with pytest.raises(ValueError):
        pool.put(b"x" * 65, [torch.ones(1)], tokens=1)
    with pytest.raises(TypeError):
        pool.put("abc", [torch.ones(1)], tokens=1)  # type: ignore[arg-type]
    pool.put(b"x" * 64, [torch.ones(1)], tokens=1)
    assert len(pool) == 1


# --------------------------------------------------------------------------- disk


def _payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_disk_round_trip_and_layout(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    data = _payload(1000, 0)
    written = store.put(_key(1), data, tokens=12)
    path = tmp_path / NS.hex()[:32] / _key(1).hex()[:2] / f"{_key(1).hex()}.kv"
    assert path.is_file() and written == path.stat().st_size == 32 + 17 + 1000
    got = store.get(_key(1))
    assert got is not None
    payload, tokens = got
    assert bytes(payload) == data and tokens == 12
    assert store.tokens(_key(1)) == 12 and _key(1) in store and len(store) == 1
    assert store.get(_key(2)) is None
    assert store.checksum_failures == 0 and store.missing == 0


def test_disk_accepts_tensor_numpy_and_memoryview(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    parts = _parts(3)
    flat = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
    store.put(_key(1), flat, tokens=1)
    store.put(_key(2), flat.numpy(), tokens=2)
    store.put(_key(3), memoryview(flat.numpy().tobytes()), tokens=3)
    store.put(_key(4), torch.arange(5, dtype=torch.int32), tokens=4)  # any dtype: its bytes
    for i in (1, 2, 3):
        outs = [torch.empty_like(p) for p in parts]
        assert store.read_into(_key(i), outs) is True
        assert all(_same_bits(o, p) for o, p in zip(outs, parts, strict=True))
    got = store.get(_key(4))
    assert got is not None and np.frombuffer(got[0], np.int32).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        store.read_into(_key(1), [torch.empty(3)])


def test_disk_host_spill_and_restore(tmp_path: Path) -> None:
    pool = HostKVPool(1 << 20)
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    parts = _parts(4)
    pool.put(_key(1), parts, tokens=9)
    blob = pool.get_bytes(_key(1))
    assert blob is not None
    store.put(_key(1), blob, pool.tokens(_key(1)))
    pool.remove(_key(1))
    outs = [torch.empty_like(p) for p in parts]
    assert store.read_into(_key(1), outs) and store.tokens(_key(1)) == 9
    assert all(_same_bits(o, p) for o, p in zip(outs, parts, strict=True))


def test_disk_write_leaves_no_temp_files(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    for i in range(5):
        store.put(_key(i), _payload(100, i), tokens=i)
    store.put(_key(2), _payload(300, 99), tokens=20)  # a replacement too
    names = [p.name for p in _kv_files(tmp_path)]
    assert len(names) == 5
    assert all(n.endswith(".kv") and not n.startswith(".") for n in names)


def test_disk_failed_rename_keeps_old_entry_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    old = _payload(100, 1)
    store.put(_key(1), old, tokens=1)
    used = store.used_bytes

    def failing_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_disk_store.os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space"):
        store.put(_key(1), _payload(200, 2), tokens=2)
    monkeypatch.undo()
    assert [p.name for p in _kv_files(tmp_path)] == [f"{_key(1).hex()}.kv"]
    got = store.get(_key(1))
    assert got is not None and bytes(got[0]) == old and got[1] == 1
    assert store.used_bytes == used
    # The reservation was released: a put filling the whole capacity still fits.
    store2 = DiskKVStore(tmp_path / "b", 1000, NS)
    monkeypatch.setattr(kv_disk_store.os, "replace", failing_replace)
    with pytest.raises(OSError):
        store2.put(_key(1), _payload(900, 3), tokens=1)
    monkeypatch.undo()
    store2.put(_key(2), _payload(900, 3), tokens=1)
    assert store2.used_bytes == 32 + 17 + 900


def test_disk_restart_rebuilds_index_ordered_by_mtime(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    sizes = {}
    for i, n in enumerate([10, 200, 3000, 40]):
        sizes[_key(i)] = store.put(_key(i), _payload(n, i), tokens=100 + i)
    # Oldest first after restart: key 2, key 0, key 3, key 1.
    for key, mtime in [(_key(2), 1_000_000), (_key(0), 2_000_000), (_key(3), 3_000_000), (_key(1), 4_000_000)]:
        os.utime(store.path(key), (mtime, mtime))
    reopened = DiskKVStore(tmp_path, 1 << 20, NS)
    assert reopened.entries() == [
        (_key(2), DiskEntry(sizes[_key(2)], 102)),
        (_key(0), DiskEntry(sizes[_key(0)], 100)),
        (_key(3), DiskEntry(sizes[_key(3)], 103)),
        (_key(1), DiskEntry(sizes[_key(1)], 101)),
    ]
    assert reopened.used_bytes == store.used_bytes == sum(sizes.values())
    assert len(reopened) == 4 and reopened.tokens(_key(3)) == 103
    got = reopened.get(_key(2))
    assert got is not None and bytes(got[0]) == _payload(3000, 2) and got[1] == 102


def test_disk_other_namespace_sees_nothing(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    store.put(_key(1), b"abc", tokens=1)
    other = DiskKVStore(tmp_path, 1 << 20, _fingerprint("model-b"))
    assert len(other) == 0 and other.entries() == [] and other.used_bytes == 0
    assert other.get(_key(1)) is None and _key(1) not in other
    # Nor does the other store disturb the first one's files.
    assert DiskKVStore(tmp_path, 1 << 20, NS).get(_key(1)) == (memoryview(b"abc"), 1)


def test_disk_capacity_accounting_matches_file_sizes(tmp_path: Path) -> None:
    cap = 2000
    store = DiskKVStore(tmp_path, cap, NS)

    def on_disk() -> int:
        return sum(p.stat().st_size for p in _kv_files(tmp_path))

    with pytest.raises(ValueError, match="exceeds"):
        store.put(_key(9), _payload(cap - 49 + 1, 0), tokens=1)  # header 32 + key 17 = 49
    assert store.put(_key(1), _payload(500, 1), tokens=1) == 549
    assert store.put(_key(2), _payload(700, 2), tokens=1) == 749
    assert store.used_bytes == on_disk() == 1298
    with pytest.raises(MemoryError, match="evict"):
        store.put(_key(3), _payload(700, 3), tokens=1)
    assert store.used_bytes == on_disk() == 1298 and _key(3) not in store
    # Replacement counts the old file as freed.
    store.put(_key(2), _payload(1400, 4), tokens=1)
    assert store.used_bytes == on_disk() == 549 + 1449
    store.remove(_key(1))
    store.remove(_key(1))
    assert store.used_bytes == on_disk() == 1449 and len(store) == 1
    assert DiskKVStore(tmp_path, cap, NS).used_bytes == 1449
    assert store.capacity_bytes == cap


def _one_entry_store(tmp_path: Path, n: int = 256) -> tuple[DiskKVStore, Path]:
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    store.put(_key(1), _payload(n, 7), tokens=5)
    store.put(_key(2), _payload(n, 8), tokens=6)
    return store, store.path(_key(1))


def _assert_dropped(store: DiskKVStore, path: Path) -> None:
    assert not path.exists()
    assert _key(1) not in store and len(store) == 1
    assert store.used_bytes == path.parent.parent.joinpath(
        _key(2).hex()[:2], f"{_key(2).hex()}.kv"
    ).stat().st_size
    # The healthy entry still reads back.
    got = store.get(_key(2))
    assert got is not None and bytes(got[0]) == _payload(256, 8)


def test_disk_flipped_payload_byte(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, path = _one_entry_store(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x40
    path.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="llm_core.kv.tiers.kv_store"):
        assert store.get(_key(1)) is None
    assert store.checksum_failures == 1 and store.missing == 0
    assert "checksum mismatch" in caplog.text
    _assert_dropped(store, path)


def test_disk_truncated_file(tmp_path: Path) -> None:
    store, path = _one_entry_store(tmp_path)
    os.truncate(path, path.stat().st_size - 1)
    outs = [torch.zeros(256, dtype=torch.uint8)]
    assert store.read_into(_key(1), outs) is False
    assert not outs[0].any()
    assert store.checksum_failures == 1 and store.missing == 0
    _assert_dropped(store, path)


def test_disk_truncated_inside_header(tmp_path: Path) -> None:
    store, path = _one_entry_store(tmp_path)
    os.truncate(path, 10)
    assert store.get(_key(1)) is None
    assert store.checksum_failures == 1
    _assert_dropped(store, path)


def test_disk_file_deleted_behind_the_store(tmp_path: Path) -> None:
    store, path = _one_entry_store(tmp_path)
    path.unlink()
    assert store.get(_key(1)) is None
    assert store.missing == 1 and store.checksum_failures == 0
    _assert_dropped(store, path)
    # A second get is a plain miss, not counted again.
    assert store.get(_key(1)) is None and store.missing == 1


def test_disk_garbage_header(tmp_path: Path) -> None:
    store, path = _one_entry_store(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[:32] = _payload(32, 123)
    path.write_bytes(raw)
    assert store.get(_key(1)) is None
    assert store.checksum_failures == 1 and store.missing == 0
    _assert_dropped(store, path)


def test_disk_file_holding_another_key_is_rejected(tmp_path: Path) -> None:
    store, path = _one_entry_store(tmp_path)
    # A well-formed file, but for key 2, sitting under key 1's name.
    path.write_bytes(store.path(_key(2)).read_bytes())
    assert store.get(_key(1)) is None
    assert store.checksum_failures == 1
    _assert_dropped(store, path)


def test_disk_failures_logged_once_per_kind(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    for i in range(4):
        store.put(_key(i), _payload(64, i), tokens=i)
    for i in range(3):
        raw = bytearray(store.path(_key(i)).read_bytes())
        raw[-1] ^= 1
        store.path(_key(i)).write_bytes(raw)
    store.path(_key(3)).unlink()
    with caplog.at_level(logging.WARNING, logger="llm_core.kv.tiers.kv_store"):
        assert [store.get(_key(i)) for i in range(4)] == [None] * 4
    assert store.checksum_failures == 3 and store.missing == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "llm_core.kv.tiers.kv_store"]
    assert len(messages) == 2
    assert sum("checksum mismatch" in m for m in messages) == 1
    assert sum("missing file" in m for m in messages) == 1
    assert len(store) == 0 and store.used_bytes == 0 and _kv_files(tmp_path) == []


def test_disk_startup_removes_temp_and_unreadable_files(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, 1 << 20, NS)
    size = store.put(_key(1), _payload(100, 1), tokens=3)
    shard = store.path(_key(1)).parent
    stale = shard / ".tmp-12345-0"
    stale.write_bytes(b"half a page")
    bad_dir = store.directory / "ab"
    bad_dir.mkdir()
    bad = bad_dir / f"ab{'00' * 16}.kv"
    bad.write_bytes(b"not a kv file at all, long enough to hold a header......")
    unrelated = store.directory / "README"
    unrelated.write_text("left alone")
    reopened = DiskKVStore(tmp_path, 1 << 20, NS)
    assert not stale.exists() and not bad.exists() and unrelated.exists()
    assert reopened.scan_dropped == 1
    assert reopened.entries() == [(_key(1), DiskEntry(size, 3))]
    assert reopened.used_bytes == size


def test_disk_scan_reads_headers_only(tmp_path: Path) -> None:
    store, path = _one_entry_store(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # payload damage is not visible at startup ...
    path.write_bytes(raw)
    reopened = DiskKVStore(tmp_path, 1 << 20, NS)
    assert _key(1) in reopened and reopened.checksum_failures == 0 and reopened.scan_dropped == 0
    assert reopened.get(_key(1)) is None  # ... only on get
    assert reopened.checksum_failures == 1 and not path.exists()


def test_disk_concurrent_put_and_get_never_returns_a_wrong_payload(tmp_path: Path) -> None:
    store = DiskKVStore(tmp_path, 1 << 24, NS)
    keys = [_key(i) for i in range(3)]
    size = 64 * 1024
    versions = 60
    stop = threading.Event()
    errors: list[str] = []
    seen: set[int] = set()

    def writer() -> None:
        try:
            for v in range(1, versions + 1):
                for k in keys:
                    store.put(k, bytes([v]) * (size + v), tokens=v)
        except BaseException as exc:  # surfaced by the main thread's asserts
            errors.append(f"writer: {exc!r}")
        finally:
            stop.set()

    def reader() -> None:
        while not stop.is_set():
            for k in keys:
                got = store.get(k)
                if got is None:
                    continue
                payload, tokens = got
                arr = np.frombuffer(payload, np.uint8)
                v = int(arr[0])
                if tokens != v or len(arr) != size + v or not (arr == v).all():
                    errors.append(f"torn read: tokens={tokens} first={v} len={len(arr)}")
                seen.add(v)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert seen  # the reader did read entries while they were being replaced
    assert store.checksum_failures == 0 and store.missing == 0
    for k in keys:
        got = store.get(k)
        assert got is not None and got[1] == versions and bytes(got[0]) == bytes([versions]) * (size + versions)
    assert [p.name.endswith(".kv") for p in _kv_files(tmp_path)] == [True] * 3
