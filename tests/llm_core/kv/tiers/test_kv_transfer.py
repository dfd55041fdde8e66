"""The native restore path (csrc/kv_page_copy.cpp) against the torch path:
the same pool bytes from host memory and from disk, every failure of a
stored page caught (a flipped byte, a short, grown, missing or misnamed
file) and counted, the same hash as the Python ``xxhash`` module."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from llm_core import LLM
from llm_core.kv.tiers.kv_transfer import EngineTierIO, page_copy_kernel

PAGES = 6


@pytest.fixture(params=[False, True], ids=["fused", "layerwise"])
def io(tiny_checkpoint: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[EngineTierIO]:
    """Restores verified and copied in one pass, or verified then copied layer by layer."""
    llm = LLM(tiny_checkpoint, page_size=4, kv_host_bytes=1 << 22, kv_disk_bytes=1 << 24,
              kv_disk_dir=str(tmp_path / "kv"), kv_restore_layerwise=request.param)
    tier_io = llm.engine.tier_io
    assert tier_io is not None and page_copy_kernel() is not None
    yield tier_io
    llm.close()


def _load(io: EngineTierIO, tier: str, keys: list[bytes], pages: list[int]) -> int:
    """A restore, and (layer by layer) the wait a step does for it."""
    loaded = io.load_full_many(tier, keys, pages)  # type: ignore[arg-type]
    io.finish_restores()
    return loaded


def _keys(n: int = PAGES) -> list[bytes]:
    return [bytes([i]) * 16 + b"F" for i in range(n)]


def _fill_and_save(io: EngineTierIO, pages: list[int]) -> list[torch.Tensor]:
    """Random KV in ``pages``, saved to host memory; what each page held."""
    gen = torch.Generator().manual_seed(0)
    for t in io.full_tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    for key, page in zip(_keys(), pages):
        io.save_full(key, page)
    # The copies run in the background; the pages may be written again only once they are back.
    assert sorted(ids[0] for _, ids in io.finished(wait=True)) == sorted(pages)
    return [torch.cat([rows.reshape(-1) for rows in io._page_rows(p)]) for p in pages]


def _pool_pages(io: EngineTierIO, pages: list[int]) -> list[torch.Tensor]:
    return [torch.cat([rows.reshape(-1) for rows in io._page_rows(p)]) for p in pages]


def _clear(io: EngineTierIO) -> None:
    for t in io.full_tensors:
        t.zero_()


def test_the_native_hash_is_the_python_modules() -> None:
    kernel = page_copy_kernel()
    assert kernel is not None
    for n in (0, 1, 17, 240, 4096, 100_003):
        blob = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        assert kernel.xxh3_64(blob) == xxhash.xxh3_64_intdigest(blob.numpy())


def test_host_restore_copies_what_was_saved_and_stops_at_a_corrupt_page(io: EngineTierIO) -> None:
    saved = _fill_and_save(io, list(range(PAGES)))
    _clear(io)
    targets = [PAGES + i for i in range(PAGES)]
    assert _load(io, "host", _keys(), targets) == PAGES
    assert all(torch.equal(a, b) for a, b in zip(_pool_pages(io, targets), saved))
    # Behind the pool's back: one byte of the fourth entry flips.
    blob = io.host.get_bytes(_keys()[3])
    assert blob is not None
    blob[5] ^= 0x10
    _clear(io)
    assert _load(io, "host", _keys(), targets) == 3
    assert all(torch.equal(a, b) for a, b in zip(_pool_pages(io, targets[:3]), saved[:3]))
    assert io.host.checksum_failures == 1 and _keys()[3] not in io.host


def test_host_restore_natively_and_by_torch_give_the_same_pool(io: EngineTierIO) -> None:
    _fill_and_save(io, list(range(PAGES)))
    _clear(io)
    assert _load(io, "host", _keys(), list(range(PAGES))) == PAGES
    native = [t.clone() for t in io.full_tensors]
    _clear(io)
    assert io._load_full_torch("host", _keys(), list(range(PAGES))) == PAGES
    assert all(torch.equal(a, b) for a, b in zip(native, io.full_tensors))


def _to_disk(io: EngineTierIO) -> None:
    assert io.writer is not None
    for key in _keys():
        io.spill(key)
    io.writer.flush()
    for key in _keys():
        io.discard("host", key)


@pytest.mark.parametrize("damage", ["flip", "truncate", "grow", "delete", "misnamed"])
def test_disk_restore_reads_files_into_pages_and_catches_every_bad_file(io: EngineTierIO, damage: str) -> None:
    saved = _fill_and_save(io, list(range(PAGES)))
    _to_disk(io)
    _clear(io)
    targets = [PAGES + i for i in range(PAGES)]
    assert _load(io, "disk", _keys(), targets) == PAGES
    assert all(torch.equal(a, b) for a, b in zip(_pool_pages(io, targets), saved))
    assert io.disk is not None
    path = io.disk.path(_keys()[2])
    data = path.read_bytes()
    if damage == "flip":
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:])
    elif damage == "truncate":
        path.write_bytes(data[:-1])
    elif damage == "grow":
        path.write_bytes(data + b"\0")
    elif damage == "delete":
        path.unlink()
    else:  # another entry's file under this key's name
        path.write_bytes(io.disk.path(_keys()[1]).read_bytes())
    _clear(io)
    assert _load(io, "disk", _keys(), targets) == 2
    failures = io.disk.missing if damage == "delete" else io.disk.checksum_failures
    assert failures == 1 and _keys()[2] not in io.disk and not path.exists()
    assert all(torch.equal(a, b) for a, b in zip(_pool_pages(io, targets[:2]), saved[:2]))


def test_a_prefetch_reads_verified_entries_and_reports_bad_ones(io: EngineTierIO) -> None:
    _fill_and_save(io, list(range(PAGES)))
    expected = {key: io.host.get_bytes(key).clone() for key in _keys()}  # type: ignore[union-attr]
    _to_disk(io)
    assert io.disk is not None
    io.disk.path(_keys()[4]).write_bytes(b"SWKV")
    got = io._read_disk(_keys() + [b"\7" * 17])  # the last is on no tier
    for key, (blob, tokens, checksum) in zip(_keys(), got):
        if key == _keys()[4]:
            assert blob is None and checksum is None
            continue
        assert blob is not None and torch.equal(blob, expected[key]) and tokens == 4
        assert checksum == xxhash.xxh3_64_intdigest(expected[key].numpy())
    assert got[-1] == (None, 0, None)
    assert io.disk.checksum_failures == 1


def _gate(io: EngineTierIO) -> threading.Event:
    """Hold every demotion copy until the returned event is set."""
    assert io.demoter is not None
    gate, copy = threading.Event(), io.demoter._copy
    io.demoter._copy = lambda job: (gate.wait(), copy(job))[1]  # type: ignore[method-assign]
    return gate


def test_a_demotion_returns_at_once_and_its_page_comes_back_only_after_the_copy(io: EngineTierIO) -> None:
    for t in io.full_tensors:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    expected = _pool_pages(io, [1])[0].clone()
    gate = _gate(io)
    assert io.save_full(_keys()[0], 1) is True  # the copy has not run: the gate is shut
    assert io.finished(wait=False) == [] and _keys()[0] not in io.host
    threading.Timer(0.2, gate.set).start()
    # A restore of an entry still on its way waits for it, then reads it.
    assert _load(io, "host", _keys()[:1], [2]) == 1
    assert torch.equal(_pool_pages(io, [2])[0], expected)
    assert io.finished(wait=True) == [(b"F", [1])]


def test_an_entry_dropped_while_its_copy_runs_leaves_nothing_behind(io: EngineTierIO) -> None:
    gate = _gate(io)
    io.save_full(_keys()[0], 0)
    io.save_swa(_keys()[1], [3, 4, 5])
    threading.Timer(0.2, gate.set).start()
    io.discard("host", _keys()[0])
    io.discard("host", _keys()[1])
    assert sorted(io.finished(wait=True)) == [(b"F", [0]), (b"S", [3, 4, 5])]
    assert len(io.host) == 0 and io.host.used_bytes == 0
