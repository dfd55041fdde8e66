"""Cross-request encoder batching as an asyncio service.

Requests arrive one media item at a time (an image, a video clip, an audio clip),
each small enough that a forward of its own leaves the device idle between tiny
kernels. ``EncoderBatcher`` queues items per encoder and, once the first item of
a batch has waited ``max_wait_ms`` or the batch holds ``max_batch_tokens`` of
work, packs them into one varlen forward and hands each request its own slice.

Forwards run on worker threads (torch releases the GIL), so the event loop keeps
accepting requests while an encoder works, and its next batch fills up during
the current forward. A bad item is refused at ``encode`` time with its
own ``ValueError``; if a packed forward still fails, the batch is re-run item by
item so only the failing item's request sees the error.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["BatchEncoder", "BatcherConfig", "BatcherStats", "EncoderBatcher"]


class BatchEncoder(Protocol):
    """What the batcher needs of an encoder (``VisionEncoder``, ``AudioEncoder``)."""

    kind: str

    @property
    def identity(self) -> str:
        """Names these weights under this config (part of embedding-cache keys)."""
        ...

    def check(self, item: Any) -> None: ...

    def cost(self, item: Any) -> int: ...

    def encode_batch(self, items: Sequence[Any]) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class BatcherConfig:
    # Longest an item waits for company before its forward starts.
    max_wait_ms: float = 5.0
    # A burst of arrivals is over once none came for this long: the batch starts
    # then instead of idling to max_wait_ms (clients that all resubmit when a
    # forward returns arrive together, within a fraction of a millisecond).
    arrival_gap_ms: float = 1.0
    # Sequence positions (patches / audio frames) per packed forward; one item
    # larger than this still runs, alone.
    max_batch_tokens: int = 32768
    # Items waiting per encoder before new ones are refused (back-pressure).
    max_queued_items: int = 4096
    # Forwards in flight at once, each of a different encoder (one encoder's items
    # always go through one forward at a time, so they batch). With 2, a vision
    # forward and an audio forward overlap on two cores.
    workers: int = 2

    def __post_init__(self) -> None:
        counts = (self.max_batch_tokens, self.max_queued_items, self.workers)
        if self.max_wait_ms < 0 or self.arrival_gap_ms < 0 or min(counts) < 1:
            raise ValueError(f"invalid batcher config {self}")


@dataclass
class BatcherStats:
    batches: int = 0
    items: int = 0
    tokens: int = 0
    failed_items: int = 0
    # items per forward -> how many forwards had that size
    batch_sizes: Counter[int] = field(default_factory=Counter)
    busy_seconds: float = 0.0


class EncoderQueueFull(RuntimeError):
    """The encoder is saturated; the caller should shed load (HTTP 429/503)."""


@dataclass
class _Pending:
    item: Any
    cost: int
    future: asyncio.Future[torch.Tensor]
    enqueued: float


class _Lane:
    """The queue and worker task of one encoder."""

    def __init__(self, encoder: BatchEncoder) -> None:
        self.encoder = encoder
        self.queue: deque[_Pending] = deque()
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.stats = BatcherStats()


class EncoderBatcher:
    """Fuses items from concurrent requests into packed encoder forwards.

    >>> batcher = EncoderBatcher([vision_encoder, audio_encoder])
    >>> emb = await batcher.encode("vision", VisionInput(...))
    """

    def __init__(
        self,
        encoders: Sequence[BatchEncoder] | Mapping[str, BatchEncoder],
        config: BatcherConfig = BatcherConfig(),
        executor: Executor | None = None,
        on_batch: Callable[[str, int], None] | None = None,
    ) -> None:
        """``on_batch(kind, items)`` is called on the event loop after every forward (metrics)."""
        pairs = encoders.items() if isinstance(encoders, Mapping) else ((e.kind, e) for e in encoders)
        self._encoders: dict[str, BatchEncoder] = dict(pairs)
        self.config = config
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="encoder")
        self._lanes: dict[str, _Lane] = {}
        self._closed = False
        self._on_batch = on_batch

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._encoders)

    def encoder(self, kind: str) -> BatchEncoder:
        try:
            return self._encoders[kind]
        except KeyError:
            raise ValueError(f"no {kind!r} encoder is loaded (have: {', '.join(self._encoders) or 'none'})") from None

    async def encode(self, kind: str, item: Any) -> torch.Tensor:
        """Embeddings of one item, computed in a packed forward with other requests' items.

        Raises ``ValueError`` (bad item, unknown kind), ``EncoderQueueFull``, or whatever
        the encoder raised for this item alone.
        """
        if self._closed:
            raise RuntimeError("encoder batcher is closed")
        encoder = self.encoder(kind)
        encoder.check(item)
        lane = self._lane(kind)
        if len(lane.queue) >= self.config.max_queued_items:
            raise EncoderQueueFull(f"{kind} encoder queue is full ({len(lane.queue)} items waiting)")
        loop = asyncio.get_running_loop()
        pending = _Pending(item, max(1, int(encoder.cost(item))), loop.create_future(), time.monotonic())
        lane.queue.append(pending)
        lane.wakeup.set()
        return await pending.future

    async def encode_many(self, kind: str, items: Sequence[Any]) -> list[torch.Tensor]:
        return list(await asyncio.gather(*(self.encode(kind, it) for it in items)))

    def stats(self) -> dict[str, BatcherStats]:
        return {kind: lane.stats for kind, lane in self._lanes.items()}

    def queue_depth(self) -> dict[str, int]:
        return {kind: len(lane.queue) for kind, lane in self._lanes.items()}

    async def aclose(self) -> None:
        self._closed = True
        for lane in self._lanes.values():
            if lane.task is not None:
                lane.task.cancel()
        for lane in self._lanes.values():
            if lane.task is not None:
                try:
                    await lane.task
                except asyncio.CancelledError:
                    pass
            while lane.queue:
                p = lane.queue.popleft()
                if not p.future.done():
                    p.future.set_exception(RuntimeError("encoder batcher closed"))
        if self._own_executor:
            self._executor.shutdown(wait=True)

    # -- worker ---------------------------------------------------------------

    def _lane(self, kind: str) -> _Lane:
        lane = self._lanes.get(kind)
        if lane is None:
            lane = self._lanes[kind] = _Lane(self._encoders[kind])
        if lane.task is None or lane.task.done():
            lane.task = asyncio.get_running_loop().create_task(self._run(lane), name=f"encoder-{kind}")
        return lane

    async def _run(self, lane: _Lane) -> None:
        while True:
            while not lane.queue:
                lane.wakeup.clear()
                await lane.wakeup.wait()
            await self._wait_for_batch(lane)
            batch = self._take_batch(lane)
            if batch:
                await self._forward(lane, batch)

    async def _wait_for_batch(self, lane: _Lane) -> None:
        """Hold the batch open while items keep arriving, until the oldest has waited
        ``max_wait_ms`` or the queue holds a full batch of work."""
        deadline = lane.queue[0].enqueued + self.config.max_wait_ms / 1000.0
        gap = self.config.arrival_gap_ms / 1000.0
        while sum(p.cost for p in lane.queue) < self.config.max_batch_tokens:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            lane.wakeup.clear()
            try:
                await asyncio.wait_for(lane.wakeup.wait(), timeout=min(remaining, gap))
            except TimeoutError:
                return

    def _take_batch(self, lane: _Lane) -> list[_Pending]:
        """FIFO items up to the token budget (the first always goes, however large);
        cancelled requests are dropped here, before they cost a forward."""
        batch: list[_Pending] = []
        budget = self.config.max_batch_tokens
        while lane.queue:
            p = lane.queue[0]
            if p.future.done():
                lane.queue.popleft()
                continue
            if batch and p.cost > budget:
                break
            batch.append(lane.queue.popleft())
            budget -= p.cost
        return batch

    async def _forward(self, lane: _Lane, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        items = [p.item for p in batch]
        started = time.perf_counter()
        try:
            outputs = await loop.run_in_executor(self._executor, lane.encoder.encode_batch, items)
            if len(outputs) != len(batch):
                kind = lane.encoder.kind
                raise RuntimeError(f"{kind} encoder returned {len(outputs)} outputs for {len(batch)} items")
            results: list[torch.Tensor | BaseException] = list(outputs)
        except Exception:  # noqa: BLE001 - isolate the failing item below
            results = await self._one_by_one(lane, items)
        lane.stats.busy_seconds += time.perf_counter() - started
        lane.stats.batches += 1
        lane.stats.items += len(batch)
        lane.stats.tokens += sum(p.cost for p in batch)
        lane.stats.batch_sizes[len(batch)] += 1
        if self._on_batch is not None:
            self._on_batch(lane.encoder.kind, len(batch))
        for p, result in zip(batch, results):
            if p.future.done():
                continue
            if isinstance(result, BaseException):
                lane.stats.failed_items += 1
                p.future.set_exception(result)
            else:
                p.future.set_result(result)

    async def _one_by_one(self, lane: _Lane, items: list[Any]) -> list[torch.Tensor | BaseException]:
        loop = asyncio.get_running_loop()
        results: list[torch.Tensor | BaseException] = []
        for item in items:
            try:
                results.append((await loop.run_in_executor(self._executor, lane.encoder.encode_batch, [item]))[0])
            except Exception as exc:  # noqa: BLE001 - delivered to this item's request only
                results.append(exc)
        return results
