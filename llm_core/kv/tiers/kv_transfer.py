"""The KV tiers' mechanism in the engine: copies between the device pools and
the host and disk stores (``kv_store.py``), for the bookkeeping of
``kv_tiers.py``.

A full page's entry is, for every full-attention layer, the page's K rows
then its V rows (a page is contiguous in each layer's tensor). An SWA entry
of n positions is, for every SWA and MTP layer, the n slots' K rows then
their V rows, then the hidden states MTP layers chain on: the window of a
checkpoint with everything speculative decoding needs to draft from it.

Disk writes, disk reads and demotions run on background threads
(``kv_tier_workers.py``), so the engine step never waits for a file. Every read is checksum-verified by the store; a bad entry is a
failed load (the bookkeeping forgets it and the tokens are recomputed).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch
import xxhash
import xxhash._xxhash

from llm_core import native
from llm_core.kv.tiers.kv_disk_store import DiskKVStore
from llm_core.kv.tiers.kv_store import HostKVPool, copy_into
from llm_core.kv.tiers.kv_tier_workers import Demoter, Demotion, DiskReader, DiskWriter, Fetched
from llm_core.kv.tiers.kv_tiers import FULL, SWA, Tier
from llm_core.kv.paged_attention import KVCacheTensors, as_bytes

log = logging.getLogger(__name__)

# Restore latency buckets (seconds), for the histogram in stats and /metrics.
RESTORE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
_U64 = (1 << 64) - 1


@cache
def page_copy_kernel() -> ModuleType | None:
    """The C++ page copy (``csrc/kv_page_copy.cpp``), built on first use;
    None where it cannot be built (the torch path is used)."""
    kernel = native.build("swallow_kv_page_copy", ("kv_page_copy.cpp",), "KV page copy",
                          cflags=("-O3", "-fopenmp"), ldflags=("-fopenmp", "-ldl"))
    if kernel is None:
        return None
    try:
        kernel.bind_xxh3(xxhash._xxhash.__file__)  # type: ignore[union-attr]  # the very hash kv_store.py computes
    except Exception as exc:  # noqa: BLE001 - without the hash the torch path is used
        log.warning("the C++ KV page copy could not bind xxh3 (%s); using the torch path", exc)
        return None
    return kernel  # type: ignore[return-value]


def model_weights_digest(model: torch.nn.Module, samples: int = 4096) -> bytes:
    """A digest of the weights: every parameter's name, shape, dtype and up to
    ``samples`` evenly strided elements. Retraining changes practically every
    element, so another checkpoint of the same shape has another digest; it
    costs one small gather per parameter, wherever the weights live."""
    h = xxhash.xxh3_128()
    for name, param in sorted(model.state_dict().items()):
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        picked = flat[::step][:samples].to("cpu", copy=True).contiguous()
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        h.update(picked.view(torch.uint8).numpy().tobytes())
    return h.digest()


@dataclass(eq=False)
class _LayerRestore:
    """Host entries on their way into device pages, one layer at a time."""

    hold: int  # the host pool's hold on the entries' bytes (CPU: released once copied)
    blobs: torch.Tensor  # int64 addresses of the entries
    pages: torch.Tensor  # int64: the page each entry goes to
    layers_done: list[threading.Event]  # CPU: set as each layer's copy finishes
    events: list[torch.cuda.Event] | None = None  # CUDA: recorded on the copy stream per layer
    staging: torch.Tensor | None = None  # CUDA: the pinned segment-major copy the device reads
    error: BaseException | None = None


class _LayerwiseRestores:
    """Full pages restored from host memory beside the forward: the entries
    are verified first (a bad one must be known before anything reads the
    pages), then copied layer after layer, and attention at layer i waits
    only for layer i's pages (``wait_layer``), never for the whole restore.

    On the CPU a thread copies (the GIL released); on CUDA the copies run
    on a side stream from one pinned staging buffer per restore, and a
    layer's wait is a stream event, not a host sync.
    """

    def __init__(self, kv: KVCacheTensors, host: HostKVPool, kernel: ModuleType) -> None:
        self.kv = kv
        self.host = host
        self.kernel = kernel
        full = [(i, k, v) for i, (is_swa, k, v) in ((i, kv.layer(i)) for i in kv.layer_ids) if not is_swa]
        self.ordinal = {i: n for n, (i, _, _) in enumerate(full)}
        self.layers = [[as_bytes(k), as_bytes(v)] for _, k, v in full]  # an FP8 pool as its bytes
        ps = kv.page_size
        self.segments = [ps * t[0].numel() * t.element_size() for pair in self.layers for t in pair]
        self.entry_bytes = sum(self.segments)
        self.offsets = [sum(self.segments[: 2 * n]) for n in range(len(self.layers))]
        self.pending: list[_LayerRestore] = []
        self._stream = torch.cuda.Stream(kv.device) if kv.device.type == "cuda" else None
        self._queue: queue.Queue[_LayerRestore | None] = queue.Queue()
        self._thread = None
        if self._stream is None:
            self._thread = threading.Thread(target=self._run, name="swallow-kv-restorer", daemon=True)
            self._thread.start()

    def start(self, hold: int, table: torch.Tensor, pages: torch.Tensor) -> int:
        """Verify the entries (``table``: address, checksum bits) and start
        copying the good ones, up to the first bad one; how many are good.
        Takes over ``hold``."""
        n = table.shape[0]
        if self._stream is not None:
            staging = torch.empty(n * self.entry_bytes, dtype=torch.uint8, pin_memory=True)
            good = self.kernel.verified_gather(table[:, 0], table[:, 1], self.segments, staging)
            self.host.release_stored(hold)  # the staging buffer has the bytes now
            if good:
                self._start_cuda(staging, n, good, pages[:good])
            return good
        good = self.kernel.verify_blobs(table[:, 0], table[:, 1], self.entry_bytes)
        if not good:
            self.host.release_stored(hold)
            return 0
        job = _LayerRestore(hold, table[:good, 0].contiguous(), pages[:good].contiguous(),
                            [threading.Event() for _ in self.layers])
        self.pending.append(job)
        self._queue.put(job)
        return good

    def _start_cuda(self, staging: torch.Tensor, n: int, good: int, pages: torch.Tensor) -> None:
        assert self._stream is not None
        ps = self.kv.page_size
        events = [torch.cuda.Event() for _ in self.layers]
        # The pages may have been read by earlier steps still on the compute stream.
        self._stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(self._stream):
            index = pages.to(self.kv.device, non_blocking=True)
            base = 0
            for layer, event in zip(self.layers, events):
                for t in layer:
                    seg = ps * t[0].numel() * t.element_size()
                    part = staging[base * n : base * n + good * seg].to(self.kv.device, non_blocking=True)
                    rows = part.view(t.dtype).view(good, ps, *t.shape[1:])
                    t.view(-1, ps, *t.shape[1:]).index_copy_(0, index, rows)
                    base += seg
                event.record(self._stream)
        self.pending.append(_LayerRestore(-1, pages, pages, [], events, staging))

    def wait_layer(self, layer_idx: int) -> None:
        """Before attention at ``layer_idx`` reads the pools."""
        n = self.ordinal.get(layer_idx)
        if n is None:
            return  # an SWA layer: its windows were restored before the step
        for job in self.pending:
            self._wait(job, n)

    def _wait(self, job: _LayerRestore, n: int) -> None:
        if job.events is not None:
            torch.cuda.current_stream(self.kv.device).wait_event(job.events[n])
            return
        job.layers_done[n].wait()
        if job.error is not None:
            raise RuntimeError(f"a KV restore failed: {job.error}") from job.error

    def finish(self) -> None:
        """Every restore started is in (for the compute stream, on CUDA)."""
        pending, self.pending = self.pending, []
        for job in pending:
            self._wait(job, len(self.layers) - 1)

    def close(self) -> None:
        self.finish()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                for offset, layer, done in zip(self.offsets, self.layers, job.layers_done):
                    self.kernel.copy_layer(job.blobs, offset, layer, job.pages, self.kv.page_size)
                    done.set()
            except BaseException as exc:  # noqa: BLE001 - the waiting forward raises it
                job.error = exc
            finally:
                for done in job.layers_done:
                    done.set()
                self.host.release_stored(job.hold)


class EngineTierIO:
    """``TierIO`` over an engine's KV tensors, a host pool and a disk store."""

    def __init__(self, kv: KVCacheTensors, host: HostKVPool, disk: DiskKVStore | None,
                 async_demotion: bool = True, layerwise_restore: bool | None = None) -> None:
        """``layerwise_restore``: restore from host memory beside the forward,
        layer by layer (default: on CUDA, where copies and compute run on
        different engines; on the CPU both share the cores, and one fused
        verify-and-copy pass before the step costs less)."""
        self.kv = kv
        self.host = host
        self.disk = disk
        self.writer = DiskWriter(disk) if disk is not None else None
        self.reader = DiskReader(self._read_disk) if disk is not None else None
        self.demoter = Demoter(self._demote) if async_demotion else None
        self._copy_stream = torch.cuda.Stream(kv.device) if async_demotion and kv.device.type == "cuda" else None
        self._fetched: dict[bytes, Fetched] = {}
        self.full_tensors, self.swa_tensors = kv.pool_tensors()
        self.full_page_bytes = kv.page_size * sum(t[0].numel() * t.element_size() for t in self.full_tensors)
        self.restore_seconds = [0] * (len(RESTORE_BUCKETS) + 1)  # histogram counts
        self.restore_seconds_sum = 0.0
        if layerwise_restore is None:
            layerwise_restore = kv.device.type == "cuda"
        kernel = page_copy_kernel() if layerwise_restore else None
        self.layerwise = _LayerwiseRestores(kv, host, kernel) if kernel is not None else None

    # ------------------------------------------------------------- saving
    def _page_rows(self, page: int) -> list[torch.Tensor]:
        ps = self.kv.page_size
        return [t[page * ps : (page + 1) * ps] for t in self.full_tensors]

    def save_full(self, key: bytes, page: int) -> bool:
        ps = self.kv.page_size
        if self.demoter is None:
            self.host.put(key, self._page_rows(page), ps)
            return False
        rows = list(range(page * ps, (page + 1) * ps))
        self._submit(Demotion(key, FULL, [page], self.full_tensors, rows, ps, self._ready()))
        return True

    def save_swa(self, key: bytes, slots: Sequence[int]) -> bool:
        if self.demoter is None:
            index = torch.tensor(list(slots), dtype=torch.long, device=self.kv.device)
            self.host.put(key, [t.index_select(0, index) for t in self.swa_tensors], len(slots))
            return False
        self._submit(Demotion(key, SWA, list(slots), self.swa_tensors, list(slots), len(slots), self._ready()))
        return True

    def _ready(self) -> torch.cuda.Event | None:
        """On CUDA, a mark after the KV writes queued so far: the copy stream
        waits for it, so the copy reads the page as the forward left it."""
        if self._copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _submit(self, job: Demotion) -> None:
        assert self.demoter is not None
        self.demoter.settle([job.key])  # a replaced entry's copy lands first
        self.demoter.submit(job)

    def _demote(self, job: Demotion) -> None:
        """The demoter thread's work: the rows into a verified host entry."""
        kernel = page_copy_kernel() if self.kv.device.type == "cpu" else None
        if kernel is not None:
            blob, checksum = kernel.gather_rows(job.tensors, job.rows, self.host.pinned)
            self.host.put_verified(job.key, blob, checksum & _U64, job.tokens)
            return
        if self._copy_stream is not None and job.ready is not None:
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(job.ready)
                index = torch.tensor(job.rows, dtype=torch.long, device=self.kv.device)
                parts = [t.index_select(0, index).to("cpu") for t in job.tensors]
        else:
            index = torch.tensor(job.rows, dtype=torch.long, device=self.kv.device)
            parts = [t.index_select(0, index) for t in job.tensors]
        self.host.put(job.key, parts, job.tokens)

    def restore_gate(self) -> Callable[[int], None] | None:
        """What attention calls before reading layer i's KV while restores
        are on their way; None when none is."""
        return self.layerwise.wait_layer if self.layerwise is not None and self.layerwise.pending else None

    def finish_restores(self) -> None:
        """Every restore started is in: before a step that cannot wait layer
        by layer (a captured or compiled forward), after every step, and
        before any page leaves the device."""
        if self.layerwise is not None and self.layerwise.pending:
            self.layerwise.finish()

    def finished(self, wait: bool) -> list[tuple[bytes, list[int]]]:
        if self.demoter is None:
            return []
        return [(job.part, job.ids) for job in self.demoter.finished(wait)]

    def _settle(self, keys: Iterable[bytes]) -> None:
        if self.demoter is not None:
            self.demoter.settle(keys)

    def spill(self, key: bytes) -> None:
        self._settle([key])
        blob = self.host.get_bytes(key)
        if blob is None or self.writer is None:
            return  # a host entry that fails its checksum is not copied to disk
        self.writer.put(key, blob, self.host.tokens(key))

    def discard(self, tier: Tier, key: bytes) -> None:
        if tier == "host":
            self._settle([key])
            self.host.remove(key)
        elif self.writer is not None:
            self.writer.remove(key)

    # ------------------------------------------------------------ loading
    def load_full_many(self, tier: Tier, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """Restore full pages, in order, up to the first that fails; how many did."""
        start = time.perf_counter()
        if tier == "host":
            self._settle(keys)  # an entry demoted a moment ago may still be on its way
        kernel = page_copy_kernel() if self.kv.device.type == "cpu" else None
        if tier == "host" and self.layerwise is not None:
            loaded = self._load_full_host(self.layerwise.kernel, keys, pages)
        elif kernel is None:
            loaded = self._load_full_torch(tier, keys, pages)
        elif tier == "host":
            loaded = self._load_full_host(kernel, keys, pages)
        else:
            loaded = self._load_full_disk(kernel, keys, pages)
        self._observe(time.perf_counter() - start, len(keys))
        return loaded

    def _load_full_torch(self, tier: Tier, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        fetch = self.host.get_bytes if tier == "host" else (lambda key: self._blob("disk", key)[0])
        loaded = 0
        for key, page in zip(keys, pages):
            blob = fetch(key)
            if blob is None:
                break
            copy_into(blob, self._page_rows(page))
            loaded += 1
        return loaded

    def _load_full_host(self, kernel: ModuleType, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """Host blobs into pages, each verified in the same pass as its copy
        (or, layer by layer, verified first and copied beside the forward)."""
        hold, stored = self.host.stored(keys)
        handed_over = False
        try:
            sized = list(itertools.takewhile(lambda entry: entry[1] == self.full_page_bytes, stored))
            if len(sized) < len(stored):  # not a page of this pool: as good as corrupt
                self.host.report_corrupt(keys[len(sized)], stored[len(sized)][0])
                stored = sized
            if not stored:
                return 0
            table = torch.tensor([(address, checksum) for address, _, checksum in stored], dtype=torch.uint64)
            table = table.view(torch.int64)
            index = torch.tensor(pages[: len(stored)], dtype=torch.long)
            if self.layerwise is not None:
                handed_over = True
                good = self.layerwise.start(hold, table, index)
            else:
                good = kernel.verified_blobs_to_pages(table[:, 0], table[:, 1], self.full_tensors, index,
                                                      self.kv.page_size)
        finally:
            if not handed_over:
                self.host.release_stored(hold)
        if good < len(stored):
            self.host.report_corrupt(keys[good], stored[good][0])
        return good

    def _load_full_disk(self, kernel: ModuleType, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """Disk files read straight into pages (verified there); an entry still
        queued for writing comes from the queue's copy."""
        assert self.disk is not None
        queued = [self.writer.queued(key) if self.writer is not None else None for key in keys]
        done = 0
        while done < len(keys):
            if (entry := queued[done]) is not None:
                kernel.blobs_to_pages([entry[0]], self.full_tensors, torch.tensor([pages[done]]), self.kv.page_size)
                done += 1
                continue
            end = done
            while end < len(keys) and queued[end] is None:
                end += 1
            run = keys[done:end]
            listed = self.disk.file_specs(run)
            specs: list[tuple[str, int]] = list(itertools.takewhile(lambda spec: spec is not None, listed))  # type: ignore[arg-type]
            if specs:
                magic, version = self.disk.header_format
                status = kernel.files_to_pages(
                    [path for path, _ in specs], list(run[: len(specs)]),
                    torch.tensor([size for _, size in specs], dtype=torch.long), magic, version,
                    self.full_tensors, torch.tensor(pages[done : done + len(specs)], dtype=torch.long),
                    self.kv.page_size).tolist()
                good = next((i for i, code in enumerate(status) if code), len(status))
                if good < len(status):
                    self.disk.report_read(run[good], status[good])
                    return done + good
                done += len(specs)
            if len(specs) < len(run):
                return done  # not on disk after all
        return done

    def load_swa(self, tier: Tier, key: bytes, slots: Sequence[int]) -> bool:
        return self._timed(lambda: self._load_swa(tier, key, slots))

    def _load_swa(self, tier: Tier, key: bytes, slots: Sequence[int]) -> bool:
        """The last ``len(slots)`` positions of an entry of ``stored`` positions."""
        blob, stored = self._blob(tier, key)
        row_bytes = [t[0].numel() * t.element_size() for t in self.swa_tensors]
        if blob is None or stored < len(slots) or blob.numel() != stored * sum(row_bytes):
            return False
        index = torch.tensor(list(slots), dtype=torch.long, device=self.kv.device)
        offset, n = 0, len(slots)
        for t, row in zip(self.swa_tensors, row_bytes):
            rows = blob[offset + (stored - n) * row : offset + stored * row]
            t.index_copy_(0, index, rows.view(t.dtype).view(n, *t.shape[1:]).to(t.device))
            offset += stored * row
        return True

    def _blob(self, tier: Tier, key: bytes) -> tuple[torch.Tensor | None, int]:
        """A verified entry's bytes and positions, from ``tier``."""
        if tier == "host":
            self._settle([key])
            blob = self.host.get_bytes(key)
            return blob, self.host.tokens(key) if blob is not None else 0
        queued = self.writer.queued(key) if self.writer is not None else None
        if queued is not None:
            return queued
        got = self.disk.get(key) if self.disk is not None else None
        if got is None:
            return None, 0
        payload, tokens = got
        return torch.frombuffer(payload, dtype=torch.uint8), tokens  # a writable array: no copy

    # ---------------------------------------------------------- prefetch
    def prefetch(self, key: bytes) -> None:
        assert self.reader is not None
        self.reader.submit(key)

    def _read_disk(self, keys: list[bytes]) -> list[Fetched]:
        """Verified disk entries (the reader thread's work), natively where the
        C++ reader is built: one pass per file, no copy after the read."""
        kernel = page_copy_kernel()
        out: dict[bytes, Fetched] = {}
        on_disk = []
        for key in keys:
            queued = self.writer.queued(key) if self.writer is not None else None
            if queued is not None:
                out[key] = (queued[0], queued[1], None)
            else:
                on_disk.append(key)
        if kernel is None or self.disk is None:
            for key in on_disk:
                blob, tokens = self._blob("disk", key)
                out[key] = (blob, tokens, None)
        else:
            specs = {key: spec for key, spec in zip(on_disk, self.disk.file_specs(on_disk)) if spec is not None}
            listed = list(specs)
            magic, version = self.disk.header_format
            got = kernel.read_files([specs[k][0] for k in listed], listed,
                                    torch.tensor([specs[k][1] for k in listed], dtype=torch.long),
                                    magic, version, self.host.pinned)
            for key, (status, tokens, checksum, blob) in zip(listed, got):
                if status:
                    self.disk.report_read(key, status)
                out[key] = (blob, tokens, checksum & _U64 if status == 0 else None)
        return [out.get(key, (None, 0, None)) for key in keys]

    def prefetched(self) -> list[tuple[bytes, bool]]:
        if self.reader is None:
            return []
        # What the previous poll did not adopt (evicted meanwhile, or in host
        # already) is not kept: only this call's reads wait for adoption.
        self._fetched = {}
        out = []
        for key, fetched in self.reader.take():
            if fetched[0] is not None:
                self._fetched[key] = fetched
            out.append((key, fetched[0] is not None))
        return out

    def adopt_prefetched(self, key: bytes) -> None:
        blob, tokens, checksum = self._fetched.pop(key)
        assert blob is not None
        if checksum is not None and blob.is_pinned() == self.host.pinned:
            self.host.put_verified(key, blob, checksum, tokens)  # just read and verified: no second copy
        else:
            self.host.put(key, [blob], tokens)

    def wait_prefetch(self, timeout: float) -> None:
        """Block until a background read finishes (or ``timeout`` seconds)."""
        if self.reader is not None:
            self.reader.ready.wait(timeout)

    def _timed(self, load: Callable[[], bool]) -> bool:
        start = time.perf_counter()
        ok = load()
        self._observe(time.perf_counter() - start, 1)
        return ok

    def _observe(self, seconds: float, entries: int) -> None:
        """One restore of ``entries`` entries: each counts at the mean time."""
        each = seconds / max(entries, 1)
        self.restore_seconds[sum(each > b for b in RESTORE_BUCKETS)] += entries
        self.restore_seconds_sum += seconds

    def close(self) -> None:
        if self.layerwise is not None:
            self.layerwise.close()
        if self.demoter is not None:
            self.demoter.close()
        if self.reader is not None:
            self.reader.close()
        if self.writer is not None:
            self.writer.close()


if __name__ == "__main__":  # `python -m llm_core.kv.tiers.kv_transfer`: build ahead of the first restore
    print("C++ KV page copy:", "built" if page_copy_kernel() is not None else "unavailable (the torch path is used)")
