"""Every graph serving uses, compiled before the first request.

A compiled forward (``EngineConfig.compile``) has one graph per set of
shape facts its guards distinguish, and under dynamic shapes with
size-oblivious sizes (``model_runner.compiled``) those facts are few: a decode
batch of one against larger ones (inductor's broadcasting checks), the kind of
attention step an MTP layer runs in, and the dense-experts threshold of a traced
MoE layer (``layers._DENSE_TOKENS``).
``warm_up`` runs short requests that reach each combination a step can
have -- decode of one request and of several (a decode page table is at
least two pages wide, so the page count adds no graph); extend (prefill
chunks, alone and beside decode rows) of one row, of one sequence and of
several, on both sides of the threshold (a compiled extend always takes
embeddings, so media rows add no graph); the MTP drafts of all of them --
so that serving, from its first request, never waits for a compile. Graphs
loaded from the inductor cache make a restarted server's warm-up quick.

``CompileCounter`` counts graphs process-wide: a process running several
compiled engines counts each one's.

``CompileCounter`` counts dynamo's graph compilations, so a server can show
(``swallow_recompiles_total``) that none happen once it is ready.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llm_core.model.layers import _DENSE_TOKENS
from llm_core.sample.params import SamplingParams

if TYPE_CHECKING:
    from llm_core.llm import LLM

__all__ = ["CompileCounter", "WarmupReport", "warm_up"]

_SEED = 0x5A11


class CompileCounter:
    """Graphs dynamo has compiled in this process (all functions), and how many
    of them came after ``mark_ready``."""

    def __init__(self) -> None:
        self._at_ready: int | None = None

    @staticmethod
    def compiled() -> int:
        # Nothing has compiled in a process that never imported dynamo; importing
        # it only to read 0 would add a second to every engine's start.
        dynamo_utils = sys.modules.get("torch._dynamo.utils")
        return 0 if dynamo_utils is None else int(dynamo_utils.counters["stats"]["unique_graphs"])

    def mark_ready(self) -> None:
        self._at_ready = self.compiled()

    @property
    def after_ready(self) -> int:
        return 0 if self._at_ready is None else self.compiled() - self._at_ready


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    graphs: int  # compiled (or loaded from the inductor cache) during the warm-up
    requests: int

    def as_dict(self) -> dict[str, float | int]:
        return {"seconds": round(self.seconds, 2), "graphs": self.graphs, "requests": self.requests}


def warm_up(llm: LLM) -> WarmupReport:
    """Run the warm-up requests, then drop what they cached; the engine is
    left as it was (no request, an empty cache), its graphs compiled."""
    started, graphs_before = time.perf_counter(), CompileCounter.compiled()
    engine = llm.engine
    page = engine.config.page_size
    # Past the dense threshold, but within one step's token budget and the pools.
    long = min(_DENSE_TOKENS + page + 1, engine.config.max_num_batched_tokens // 2)
    prompts = _Prompts(llm.config.vocab_size)
    # Decode of one request and of several, each with extends short and long.
    repeated = prompts.make(2 * page + 3, 2)
    batches = [
        [prompts.make(1, 2)],  # a one-token prompt: an extend of one row
        [repeated], [repeated],  # a full prefix hit: one row computed over cached KV
        [prompts.make(3, page + 2)],
        [prompts.make(3, page + 2), prompts.make(5, page + 2)],
        [prompts.make(long, 3)],
        [prompts.make(long, 3), prompts.make(long + 7, 3)],
    ]
    count = 0
    for batch in batches:
        llm.generate([p for p, _ in batch], [params for _, params in batch])
        count += len(batch)
    # Prefill chunks beside decode rows, short and long.
    count += _staggered(llm, [prompts.make(4, 6), prompts.make(9, 4), prompts.make(long, 3)])
    llm.flush_cache()
    engine.reset_stats()
    return WarmupReport(time.perf_counter() - started, CompileCounter.compiled() - graphs_before, count)


class _Prompts:
    def __init__(self, vocab: int) -> None:
        self._rng = random.Random(_SEED)
        self._vocab = vocab

    def make(self, length: int, max_tokens: int) -> tuple[list[int], SamplingParams]:
        ids = [self._rng.randrange(3, self._vocab) for _ in range(length)]
        return ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _staggered(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> int:
    """Each request added once the ones before it are decoding."""
    live: set[int] = set()
    for prompt, params in requests:
        live.add(llm.add_request(prompt, params))
        for _ in range(2):
            live -= _finished(llm.step())
    while live:
        live -= _finished(llm.step())
    return len(requests)


def _finished(events: list) -> set[int]:  # noqa: ANN001 - llm_core.engine.TokenEvent
    return {event.request_id for event in events if event.finish_reason is not None}
