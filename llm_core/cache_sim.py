"""Prefix-cache simulator: the engine's scheduler, allocator and radix cache
driven by token sequences, without any model forward.

Requests run one after another; outputs are given, not sampled. Memory
behaves as in the engine: prompts are prefilled in chunks with the SWA ring
released between chunks, checkpoints are taken at the same points, and
eviction happens on pool pressure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from llm_core.kv_pool import FullKVPool, KVAllocator, SWAKVPool
from llm_core.prefix_cache import RadixCache
from llm_core.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence

Policy = Literal["window", "keep_all", "no_checkpoints"]
POLICIES: tuple[Policy, ...] = ("window", "keep_all", "no_checkpoints")


@dataclass
class SimResult:
    requests: int = 0
    failed: int = 0  # requests that could not fit in the pools at all
    prompt_tokens: int = 0
    cached_tokens: int = 0
    peak_full_tokens: int = 0
    peak_swa_tokens: int = 0
    per_request_cached: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class CacheSimulator:
    """``policy``: ``window`` (this engine: SWA ring, checkpoints, fallback),
    ``keep_all`` (SWA KV kept for every token, as engines without SWA support
    do), ``no_checkpoints`` (SWA ring, SWA kept only where requests end,
    tombstones without fallback)."""

    def __init__(
        self,
        page_size: int,
        window: int,
        full_tokens: int,
        swa_tokens: int,
        policy: Policy = "window",
        chunk: int = 8192,
        checkpoint_interval: int | None = None,
    ) -> None:
        mode = "full" if policy == "keep_all" else "hybrid"
        self.allocator = KVAllocator(
            FullKVPool(full_tokens // page_size, page_size), SWAKVPool(swa_tokens, 1), window, mode
        )
        self.cache = RadixCache(
            self.allocator,
            checkpoint_interval,
            fallback=policy != "no_checkpoints",
            prompt_checkpoints=policy != "no_checkpoints",
        )
        self.scheduler = Scheduler(self.allocator, SchedulerConfig(1, chunk, chunk), self.cache)
        self.result = SimResult()
        self._next_id = 0

    def run(
        self,
        prompt: list[int],
        output: list[int],
        on_compute: Callable[[ScheduledChunk], None] | None = None,
    ) -> int:
        """Serve one request to completion; returns its cached prompt tokens.
        ``on_compute`` sees every chunk where a forward would run."""
        seq = Sequence(self._next_id, prompt, max(len(output), 1), self.allocator.new_view())
        self._next_id += 1
        self.scheduler.add(seq)
        try:
            while seq.finish_reason is None:
                chunks = self.scheduler.schedule()
                if on_compute is not None:
                    for chunk in chunks:
                        on_compute(chunk)
                self.scheduler.after_step(chunks)
                self._track_peaks()
                if any(c.samples for c in chunks):
                    if seq.output or not output:
                        self.scheduler.finish(seq, "length")
                    else:
                        seq.output.extend(output)  # decode, as one extension of the sequence
        except MemoryError:
            self.scheduler.finish(seq, "abort")
            self.result.failed += 1
        cached = seq.cached_tokens or 0
        self.result.requests += 1
        self.result.prompt_tokens += len(prompt)
        self.result.cached_tokens += cached
        self.result.per_request_cached.append(cached)
        return cached

    def _track_peaks(self) -> None:
        full, swa = self.allocator.full, self.allocator.swa
        self.result.peak_full_tokens = max(self.result.peak_full_tokens, full.capacity - full.free_slots)
        self.result.peak_swa_tokens = max(self.result.peak_swa_tokens, swa.capacity - swa.free_slots)
