"""``swallow bench tiers``: the KV tiers' restore path, measured.

On a model of the demo's shape (random weights, a longer context), one run
measures:

* restore bandwidth host -> device and disk -> device (every stored page of
  a long prompt, checksums verified), each against a raw copy of the same
  bytes (one ``copy_`` of a contiguous buffer) and a raw read of the same
  files (``read`` into a buffer, nothing checked or copied further);
* time to first token of a prompt whose prefix (2K-32K tokens) is restored
  from host memory, from disk, or recomputed (no cache), and the prefix
  length from which restoring beats recomputing.

Disk reads come from the OS page cache (the files were just written): the
figure is the restore path's own cost, not the drive's.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import log
from demo.model import demo_llm_config
from llm_core import LLM, SamplingParams
from llm_core.loading.checkpoint import write_random_checkpoint
from llm_core.kv.tiers.kv_tiers import FULL, KVTiers
from llm_core.kv.tiers.kv_transfer import EngineTierIO, page_copy_kernel

__all__ = ["tiers_bench"]

DEFAULT_LENGTHS = (2048, 4096, 8192, 16384, 32768)
VOCAB = 431


def _checkpoint(out: Path, context: int) -> Path:
    config = dataclasses.replace(demo_llm_config(VOCAB, 1), max_position_embeddings=context)
    return write_random_checkpoint(out, config, seed=0)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    return time.perf_counter() - start


def _tiers(llm: LLM) -> tuple[KVTiers, EngineTierIO]:
    cache = llm.engine.cache
    assert cache is not None and cache.tiers is not None and llm.engine.tier_io is not None
    return cache.tiers, llm.engine.tier_io


def _to_disk(llm: LLM) -> None:
    """Everything cached leaves the device and host memory for disk."""
    llm.flush_cache()
    tiers, io = _tiers(llm)
    tiers.spill_host()
    assert io.writer is not None
    io.writer.flush()


def _best(repeats: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(repeats))


def _bandwidth(llm: LLM, tier: str, repeats: int) -> dict[str, float]:
    """Restore every full page ``tier`` holds into device pages, against a raw
    copy (host) or raw file read (disk) of the same bytes.

    From disk, two paths: the engine's (a background read into host memory,
    verified, then restored from there, as a request waiting for disk gets
    it) against a raw read on one thread, as the reader has; and a direct
    read of the files into the pages (``load_full_many`` from disk) against a
    raw read on as many threads as it uses."""
    tiers, io = _tiers(llm)
    keys = [k for k in tiers.index(tier).keys() if k.endswith(FULL)]  # type: ignore[arg-type]
    allocator = llm.engine.allocator
    pages = allocator.full.allocate(min(len(keys), allocator.full.free_pages))
    keys = keys[: len(pages)]
    nbytes = len(keys) * tiers.config.full_page_bytes
    out: dict[str, float] = {"pages": len(keys), "bytes": nbytes}

    def timed(run: Callable[[], None]) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    def direct() -> None:  # one run of pages, as a prefix restore moves them
        assert io.load_full_many(tier, keys, pages) == len(keys)  # type: ignore[arg-type]

    if tier == "host":
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        dst = torch.empty_like(src, device=llm.engine.kv.device)
        restore_s = _best(repeats, lambda: timed(direct))
        raw_s = _best(repeats, lambda: timed(lambda: dst.copy_(src)))
        out.update(restore_gbps=nbytes / restore_s / 1e9, raw_gbps=nbytes / raw_s / 1e9, ratio=raw_s / restore_s)
    else:
        assert io.disk is not None
        kernel = page_copy_kernel()
        paths = [str(io.disk.path(k)) for k in keys]
        sizes = [Path(p).stat().st_size for p in paths]
        # The raw read lands every file in its own part of one buffer (touched
        # first), as the restore lands them in the pool: the same bytes reach
        # memory, not one cache-hot scratch buffer.
        into = torch.ones(sum(sizes), dtype=torch.uint8)

        def raw_read(parallel: bool) -> None:
            if kernel is not None:
                kernel.read_files_raw(paths, torch.tensor(sizes), into, parallel)
                return
            view, offset = memoryview(into.numpy()), 0
            for path, size in zip(paths, sizes):
                with open(path, "rb", buffering=0) as f:
                    f.readinto(view[offset : offset + size])
                offset += size

        def engine_path() -> float:
            for key in keys:  # host memory holds none of them: each comes from disk
                tiers.host.remove(key)
                io.discard("host", key)
            start = time.perf_counter()
            waiting = tiers.prefetch(keys)
            while waiting:
                io.wait_prefetch(0.01)
                tiers.poll()
                waiting = bool(tiers.loading)
            assert tiers.load_full_run([k[: -len(FULL)] for k in keys], pages) == len(keys)
            return time.perf_counter() - start

        via_host_s = _best(repeats, engine_path)
        raw_one_s = _best(repeats, lambda: timed(lambda: raw_read(False)))
        for key in keys:
            tiers.host.remove(key)
            io.discard("host", key)
        direct_s = _best(repeats, lambda: timed(direct))
        raw_all_s = _best(repeats, lambda: timed(lambda: raw_read(True)))
        out.update(restore_gbps=nbytes / via_host_s / 1e9, raw_gbps=nbytes / raw_one_s / 1e9,
                   ratio=raw_one_s / via_host_s, direct_gbps=nbytes / direct_s / 1e9,
                   raw_parallel_gbps=nbytes / raw_all_s / 1e9, direct_ratio=raw_all_s / direct_s)
    allocator.full.release(pages)
    return out


def tiers_bench(lengths: tuple[int, ...] = DEFAULT_LENGTHS, repeats: int = 2, page_size: int = 16,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = log or (lambda _msg: None)
    longest = max(lengths)
    with tempfile.TemporaryDirectory(prefix="swallow-bench-tiers-") as tmp:
        model = _checkpoint(Path(tmp) / "model", max(longest, 300) + 64)
        kv_bytes = 4 * longest * 2048 + (64 << 20)
        llm = LLM(model, page_size=page_size, chunked_prefill_size=4096, max_num_batched_tokens=4096,
                  kv_budget_bytes=kv_bytes, kv_host_bytes=2 * kv_bytes, kv_disk_bytes=4 * kv_bytes,
                  kv_disk_dir=str(Path(tmp) / "kv"), speculative_tokens=0)
        _ttft(llm, _prompt(999, 300))  # warm-up, untimed
        rows = []
        for n in lengths:
            say(f"prefix of {n} tokens")
            prefix = _prompt(n, n)
            suffix = _prompt(n + 1, 16)

            def recompute_once() -> float:
                llm.flush_cache()
                _tiers(llm)[0].clear()
                return _ttft(llm, prefix + suffix)

            recompute = _best(repeats, recompute_once)
            host = []
            disk = []
            for _ in range(repeats):
                llm.flush_cache()
                _tiers(llm)[0].clear()
                _ttft(llm, prefix)  # computes and caches the prefix
                llm.flush_cache()  # ... which goes to host memory
                before = llm.stats()["prefix_cache"]["cached_tokens_by_tier"]["host"]
                host.append(_ttft(llm, prefix + suffix))
                assert llm.stats()["prefix_cache"]["cached_tokens_by_tier"]["host"] - before >= n - 2 * page_size
                _to_disk(llm)
                before = llm.stats()["prefix_cache"]["cached_tokens_by_tier"]["disk"]
                disk.append(_ttft(llm, prefix + suffix))
                assert llm.stats()["prefix_cache"]["cached_tokens_by_tier"]["disk"] - before >= n - 2 * page_size
            rows.append({"prefix_tokens": n, "ttft_recompute_s": round(recompute, 4),
                         "ttft_restore_host_s": round(min(host), 4), "ttft_restore_disk_s": round(min(disk), 4)})
        # Bandwidth on the longest prefix's pages.
        llm.flush_cache()
        _tiers(llm)[0].clear()
        _ttft(llm, _prompt(longest, longest))
        llm.flush_cache()
        host_bw = _bandwidth(llm, "host", repeats)
        _to_disk(llm)
        disk_bw = _bandwidth(llm, "disk", repeats)
        llm.close()
    crossover = {tier: next((r["prefix_tokens"] for r in rows if r[f"ttft_restore_{tier}_s"] < r["ttft_recompute_s"]),
                            None) for tier in ("host", "disk")}
    return {
        "model": "demo shape (4 layers, hidden 256, W=32), random weights, float32, CPU",
        "page_size": page_size,
        "host_restore_vs_memcpy": round(host_bw["ratio"], 3),
        "disk_restore_vs_read": round(disk_bw["ratio"], 3),
        "host_restore_gbps": round(host_bw["restore_gbps"], 3), "memcpy_gbps": round(host_bw["raw_gbps"], 3),
        "disk_restore_gbps": round(disk_bw["restore_gbps"], 3), "file_read_gbps": round(disk_bw["raw_gbps"], 3),
        "disk_direct_restore_vs_read": round(disk_bw["direct_ratio"], 3),
        "disk_direct_restore_gbps": round(disk_bw["direct_gbps"], 3),
        "file_read_parallel_gbps": round(disk_bw["raw_parallel_gbps"], 3),
        "restored_pages": host_bw["pages"],
        "ttft_restore_host_s": {r["prefix_tokens"]: r["ttft_restore_host_s"] for r in rows},
        "ttft_restore_disk_s": {r["prefix_tokens"]: r["ttft_restore_disk_s"] for r in rows},
        "ttft_recompute_s": {r["prefix_tokens"]: r["ttft_recompute_s"] for r in rows},
        "crossover_tokens": crossover,
        "rows": rows,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", help="cached prefix lengths, comma-separated (default: 2048..32768)")
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs")
    parser.add_argument("--page-size", type=int, default=16, help="full-pool page size")


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else DEFAULT_LENGTHS
    return tiers_bench(lengths, repeats=args.repeats, page_size=args.page_size, log=log)
