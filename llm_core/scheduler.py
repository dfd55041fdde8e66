"""Continuous batching with chunked prefill, over the KV allocator only.

Each step: every running request in decode gets one token; requests still
prefilling get the next chunk of their prompt; waiting requests are admitted
while the token budget, the running limit and both pools allow. When a
decode cannot get memory, the most recently admitted request is preempted
by recompute (its KV is freed and it goes back to the front of the queue).
No torch here: the engine turns the schedule into a forward batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llm_core.kv_pool import KVAllocator, SequenceView


@dataclass
class Sequence:
    request_id: int
    prompt: list[int]
    max_tokens: int
    view: SequenceView
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pools
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n : end - n]
        if end <= n:
            return self.prompt[start:end]
        return self.prompt[start:] + self.output[: end - n]

    @property
    def in_decode(self) -> bool:
        return self.num_tokens - self.num_computed == 1 and len(self.output) > 0


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step
    length: int

    @property
    def samples(self) -> bool:
        """Whether the step's last position ends the known tokens (a token is sampled)."""
        return self.start + self.length == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_num_batched_tokens: int = 4096
    chunked_prefill_size: int = 1024

    def __post_init__(self) -> None:
        if min(self.max_running_requests, self.max_num_batched_tokens, self.chunked_prefill_size) < 1:
            raise ValueError("scheduler limits must be positive")


class Scheduler:
    def __init__(self, allocator: KVAllocator, config: SchedulerConfig) -> None:
        self.allocator = allocator
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # Decodes first: they hold memory already and each costs one token.
        for seq in [s for s in self.running if s.in_decode]:
            if seq not in self.running:
                continue  # preempted below to make room for an earlier one
            if budget < 1 or not self._grow_or_preempt(seq, seq.num_computed + 1):
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed, 1))
            budget -= 1
        for seq in [s for s in self.running if not s.in_decode]:
            if budget < 1:
                break
            if chunk := self._prefill_chunk(seq, budget):
                chunks.append(chunk)
                budget -= chunk.length
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            seq = self.waiting[0]
            chunk = self._prefill_chunk(seq, budget)
            if chunk is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(chunk)
            budget -= chunk.length
        if not chunks and len(self.running) > 1:
            # Every running request is stuck on memory: free the newest and retry.
            self.preempt(self.running[-1])
            return self.schedule()
        if not chunks and self.has_unfinished():
            seq = (self.running or list(self.waiting))[0]
            raise MemoryError(
                f"request {seq.request_id} needs more KV memory than the pools have "
                f"({seq.num_tokens} tokens)"
            )
        return chunks

    def _prefill_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        n = min(seq.num_tokens - seq.num_computed, self.config.chunked_prefill_size, budget)
        if n < 1 or not self.allocator.can_grow(seq.view, seq.num_computed + n):
            return None
        self.allocator.grow(seq.view, seq.num_computed + n)
        return ScheduledChunk(seq, seq.num_computed, n)

    def _grow_or_preempt(self, seq: Sequence, new_len: int) -> bool:
        while not self.allocator.can_grow(seq.view, new_len):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.allocator.grow(seq.view, new_len)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running request's KV; it recomputes prompt + output later."""
        self.allocator.free(seq.view)
        seq.num_computed = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        """Advance computed counts and return SWA slots that left the window."""
        for chunk in chunks:
            chunk.seq.num_computed = chunk.start + chunk.length
            self.allocator.release_out_of_window(chunk.seq.view, chunk.seq.num_computed)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.allocator.free(seq.view)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
