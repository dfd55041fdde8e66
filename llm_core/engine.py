"""The continuous-batching engine: scheduler + KV pools + model + sampler."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence as SequenceOf
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from llm_core.block_table import BlockTable
from llm_core.cuda_graphs import DecodeGraphs, graph_batch_sizes
from llm_core.device import to_device
from llm_core.kv_pool import FullKVPool, KVAllocator, PoolSizing, SWAKVPool, SWAMode
from llm_core.model import MiMoV2ForCausalLM
from llm_core.multimodal import MultimodalSpan, check_spans, with_cache_tokens
from llm_core.paged_attention import (
    AttentionFn,
    DecodeAttentionBackend,
    DecodeAttentionFn,
    DecodeBatch,
    KVCacheTensors,
    PagedAttentionBackend,
    PagedBatch,
    paged_attention_torch,
    paged_decode_attention_torch,
)
from llm_core.prefix_cache import RadixCache
from llm_core.sampling import SamplingParams, SamplingPlan, SamplingRow, request_seed, sample_tokens
from llm_core.scheduler import RequestTooLarge, ScheduledChunk, Scheduler, SchedulerConfig, Sequence

AttentionImpl = Literal["auto", "torch", "triton"]
DecodeForwardFn = Callable[[MiMoV2ForCausalLM, torch.Tensor, torch.Tensor, DecodeAttentionBackend], torch.Tensor]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    kv_budget_bytes: int = 256 << 20
    page_size: int = 16
    swa_mode: SWAMode = "hybrid"
    max_running_requests: int = 64
    max_num_batched_tokens: int = 4096
    chunked_prefill_size: int = 1024
    attention: AttentionImpl = "auto"
    enable_prefix_caching: bool = True
    # Extra SWA checkpoints every N tokens (besides prompt ends and finished
    # requests), so a prompt diverging mid-way falls back at most this far.
    checkpoint_interval: int | None = 4096
    # torch.compile(fullgraph=True) the decode forward (one graph, dynamic
    # batch and context sizes; the first steps pay for compiling it).
    compile: bool = False
    # On CUDA with the Triton kernels: replay decode steps of up to this many
    # requests from CUDA graphs captured at start-up for padded batch sizes
    # (0: never; None: up to max_running_requests).
    cuda_graph_max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.swa_mode not in ("hybrid", "full"):
            raise ValueError(f"swa_mode must be 'hybrid' or 'full', got {self.swa_mode!r}")
        if self.attention not in ("auto", "torch", "triton"):
            raise ValueError(f"attention must be 'auto', 'torch' or 'triton', got {self.attention!r}")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}")


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    token: int  # -1 on an "error" event
    finish_reason: str | None  # set on the request's last event: "stop", "length" or "error"
    error: str | None = None  # why the request failed, with finish_reason "error"


class EngineFault(RuntimeError):
    """A step failed in a way no request explains (the device is unusable, or the
    engine's own bookkeeping broke): every request in flight is lost and the
    engine must be rebuilt before it serves again."""


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    backend: PagedAttentionBackend | DecodeAttentionBackend
    inputs_embeds: torch.Tensor | None


@dataclass(frozen=True)
class _Sampling:
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int


def page_slots(pages: list[int], base_page: int, page_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of positions [start, end) given the physical pages of logical
    pages base_page, base_page + 1, ... (vectorised: sequences are long)."""
    first_page = start // page_size
    used = torch.tensor(pages[first_page - base_page : -(-end // page_size) - base_page], dtype=torch.int64)
    slots = (used[:, None] * page_size + torch.arange(page_size)).flatten()
    offset = start - first_page * page_size
    return slots[offset : offset + end - start]


def _sample_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """Batch rows whose hidden state gives a next token: each sampling chunk's last."""
    rows, offset = [], 0
    for chunk in chunks:
        offset += chunk.length
        if chunk.samples:
            rows.append(offset - 1)
    return rows


def uses_triton(impl: AttentionImpl, device: torch.device) -> bool:
    return impl == "triton" or (impl == "auto" and device.type == "cuda")


def resolve_attention(impl: AttentionImpl, device: torch.device) -> AttentionFn:
    if uses_triton(impl, device):
        from llm_core.triton_attention import paged_attention_triton

        return paged_attention_triton
    return paged_attention_torch


def resolve_decode_attention(impl: AttentionImpl, device: torch.device) -> DecodeAttentionFn:
    if uses_triton(impl, device):
        from llm_core.triton_attention import paged_decode_attention_triton

        return paged_decode_attention_triton
    if impl == "auto" and device.type == "cpu":
        from llm_core import cpu_attention

        if cpu_attention.available():
            return cpu_attention.paged_decode_attention_cpu
    return paged_decode_attention_torch


def decode_logits(model: MiMoV2ForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  backend: DecodeAttentionBackend) -> torch.Tensor:
    """The decode forward, logits included: what is compiled and captured."""
    return model.compute_logits(model(input_ids, positions, backend))


def extend_hidden(model: MiMoV2ForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  backend: PagedAttentionBackend, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
    """The forward of a step with prefill chunks: final hidden states."""
    return model(input_ids, positions, backend, inputs_embeds=inputs_embeds)


def compiled(fn: Callable[..., torch.Tensor], backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """``fn`` under torch.compile(fullgraph=True) with dynamic shapes: one graph
    for every batch size and context (sizes 0 and 1 aside, which torch specialises)."""
    graph = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)

    def run(*args: Any) -> torch.Tensor:
        # Without duck sizing, two sizes that happen to be equal when a graph is
        # traced (batch and page count, say) are not assumed equal forever,
        # which would recompile it when they part.
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return graph(*args)

    return run


def compiled_decode_logits(backend: str = "inductor") -> DecodeForwardFn:
    return compiled(decode_logits, backend)


class Engine:
    def __init__(self, model: MiMoV2ForCausalLM, config: EngineConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        mc = model.config
        dtype = model.lm_head.weight.dtype
        probe = KVCacheTensors(mc, 0, 0, dtype, "meta")
        self.window = mc.sliding_attention.sliding_window or 1
        sizing = PoolSizing.from_budget(
            config.kv_budget_bytes,
            probe.full_bytes_per_token,
            probe.swa_bytes_per_token,
            # Windows are kept from a page boundary: up to a page more per request.
            self.window + config.page_size - 1,
            config.page_size,
            config.max_running_requests,
            config.max_num_batched_tokens,
            config.swa_mode,
        )
        self.allocator = KVAllocator(
            FullKVPool(sizing.full_tokens // config.page_size, config.page_size),
            SWAKVPool(sizing.swa_tokens, 1),
            self.window,
            config.swa_mode,
        )
        self.kv = KVCacheTensors(mc, self.allocator.full.capacity, self.allocator.swa.capacity, dtype, device,
                                 config.page_size)
        longest = min(mc.max_position_embeddings, self.allocator.full.capacity)
        self.block_table = BlockTable(-(-longest // config.page_size), device, config.max_running_requests)
        self.cache = RadixCache(self.allocator, config.checkpoint_interval) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.allocator,
            SchedulerConfig(config.max_running_requests, config.max_num_batched_tokens, config.chunked_prefill_size),
            self.cache,
        )
        self.attention_fn = resolve_attention(config.attention, device)
        self.decode_attention_fn = resolve_decode_attention(config.attention, device)
        self._decode_logits = compiled_decode_logits() if config.compile else decode_logits
        self._extend_hidden = compiled(extend_hidden) if config.compile else extend_hidden
        self.graphs = self._capture_graphs()
        self._sampling: dict[int, _Sampling] = {}
        self._sequences: dict[int, Sequence] = {}
        # Multimodal spans of running requests only (embeddings already on the
        # engine's device and dtype); requests without spans have no entry.
        self._spans: dict[int, tuple[MultimodalSpan, ...]] = {}
        self._next_id = 0

    # -------------------------------------------------------------- requests
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """A request that could never fit in the full pool is refused up front."""
        if num_prompt_tokens + max_tokens > self.allocator.full.capacity:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens={max_tokens} needs more KV "
                f"memory than the pool holds ({self.allocator.full.capacity} tokens)"
            )
        longest = self.block_table.width * self.allocator.full.page_size
        if num_prompt_tokens + max_tokens > longest:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens={max_tokens} is longer than "
                f"a sequence may be ({longest} tokens)"
            )

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        eos_ids: tuple[int, ...] = (),
        mm_spans: SequenceOf[MultimodalSpan] = (),
    ) -> int:
        """Queue a request. Each of ``mm_spans`` replaces the embeddings of its
        prompt positions (the placeholder tokens there are only looked up, never fed)."""
        check_spans(mm_spans, len(prompt), self.model.config.hidden_size)
        params.check_vocabulary(self.model.config.vocab_size)
        self.check_fits(len(prompt), params.max_tokens)
        spans = self._place_spans(mm_spans)
        request_id = self._next_id
        self._next_id += 1
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self._sampling[request_id] = _Sampling(params, frozenset(stop_ids), request_seed(params))
        # Prefix-cache keys see each span's content key, not its placeholder ids.
        cache_prompt = with_cache_tokens(prompt, spans) if spans else list(prompt)
        seq = Sequence(request_id, cache_prompt, params.max_tokens, self.allocator.new_view())
        self._sequences[request_id] = seq
        if spans:
            self._spans[request_id] = spans
        self.scheduler.add(seq)
        return request_id

    def _place_spans(self, spans: SequenceOf[MultimodalSpan]) -> tuple[MultimodalSpan, ...]:
        """The spans with embeddings on the engine's device and dtype, moved
        once here rather than on every forward that reads them."""
        dtype = self.model.model.embed_tokens.weight.dtype
        return tuple(
            replace(span, embeddings=span.embeddings.detach().to(device=self.device, dtype=dtype))
            for span in spans
        )

    def abort(self, request_id: int) -> bool:
        """Stop a request now and free all its KV. False if it already ended."""
        seq = self._sequences.get(request_id)
        if seq is None:
            return False
        self._end(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenEvent]:
        """One forward over the scheduled batch and a token for every chunk that ends
        its known tokens.

        A failure that belongs to some requests -- a media span that cannot be
        read, a row that cannot be sampled -- ends only those, each with an
        "error" event: the batch is split in halves until the failing chunks are
        found, and every other request gets the tokens it would have got anyway
        (greedy output does not depend on batch composition). Anything else
        raises EngineFault.
        """
        try:
            chunks = self.scheduler.schedule()
        except RequestTooLarge as exc:
            return [self._fail(exc.seq, exc)]
        if not chunks:
            return []
        return self._run(chunks)

    def _run(self, chunks: list[ScheduledChunk]) -> list[TokenEvent]:
        sampled = [c for c in chunks if c.samples]
        try:
            logits = self._logits(chunks)
        except Exception as exc:  # noqa: BLE001 - narrowed to the failing requests below
            return self._isolate(chunks, exc)
        # Only now does the step count: a failed forward left every chunk as it was
        # (its KV slots are simply written again by the retry).
        self.scheduler.after_step(chunks)
        if logits is None:
            return []
        return self._sample(sampled, logits)

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[TokenEvent]:
        """One batched draw for every row and one device-to-host copy of the tokens;
        if it fails, row by row, so only the rows that fail end (e.g. NaN logits)."""
        rows = [self._sampling_row(chunk.seq) for chunk in chunks]
        try:
            plan = SamplingPlan.build(rows, logits.shape[-1], logits.device)
            tokens = sample_tokens(logits, plan).tolist()
        except Exception as exc:  # noqa: BLE001 - narrowed to the failing rows below
            if len(chunks) == 1:
                return [self._fail(chunks[0].seq, exc)]
            return [event for i, chunk in enumerate(chunks) for event in self._sample([chunk], logits[i : i + 1])]
        return [self._accept(chunk.seq, token) for chunk, token in zip(chunks, tokens)]

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        sampling = self._sampling[seq.request_id]
        # The token count, not a step count: preemption and recompute draw the same.
        return SamplingRow(sampling.params, sampling.seed, len(seq.output))

    def _isolate(self, chunks: list[ScheduledChunk], exc: Exception) -> list[TokenEvent]:
        if self._device_lost():
            raise EngineFault(f"the {self.device} device failed: {type(exc).__name__}: {exc}") from exc
        if len(chunks) == 1:
            return [self._fail(chunks[0].seq, exc)]
        mid = len(chunks) // 2
        return self._run(chunks[:mid]) + self._run(chunks[mid:])

    def _device_lost(self) -> bool:
        """After a CUDA error the context may be unusable; a CPU cannot be lost."""
        if self.device.type != "cuda":
            return False
        try:
            torch.cuda.synchronize(self.device)
            torch.ones(1, device=self.device).add_(1).cpu()
        except Exception:  # noqa: BLE001 - any failure here means the device is gone
            return True
        return False

    def _fail(self, seq: Sequence, exc: Exception) -> TokenEvent:
        log.error("request %d failed", seq.request_id, exc_info=exc)
        self._end(seq, "error")
        return TokenEvent(seq.request_id, -1, "error", error=f"{type(exc).__name__}: {exc}")

    def _logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Logits of every chunk that samples, in chunk order; None if none does."""
        rows = _sample_rows(chunks)
        step = self.prepare_step(chunks)
        if isinstance(step.backend, DecodeAttentionBackend):
            # One row per chunk: the graphs and the compiled forward compute them all.
            logits = self._decode_step(step)
            return logits if len(rows) == len(chunks) else (logits[rows] if rows else None)
        hidden = self._extend_hidden(self.model, step.input_ids, step.positions, step.backend, step.inputs_embeds)
        return self.model.compute_logits(hidden[rows]) if rows else None

    def _decode_step(self, step: StepInputs) -> torch.Tensor:
        if self.graphs is not None and step.input_ids.shape[0] <= self.graphs.max_batch:
            return self.graphs.replay(step.input_ids, step.backend.batch)  # type: ignore[union-attr]
        return self._decode_logits(self.model, step.input_ids, step.positions, step.backend)

    def _capture_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of the decode forward, where it is captured: on CUDA with
        the Triton kernels (the torch path gathers the whole table width)."""
        limit = self.config.cuda_graph_max_batch
        limit = self.config.max_running_requests if limit is None else min(limit, self.config.max_running_requests)
        if self.device.type != "cuda" or limit == 0 or not uses_triton(self.config.attention, self.device):
            return None
        return DecodeGraphs(
            lambda ids, batch: self._decode_logits(self.model, ids, batch.positions,
                                                   DecodeAttentionBackend(self.kv, batch, self.decode_attention_fn)),
            self.kv, graph_batch_sizes(limit), self.block_table.width, self.window, self.device,
        )

    def prepare_step(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Everything the forward needs, at O(batch + new tokens + W per request)
        host cost: full-pool keys come through the block table, never as lists."""
        if all(chunk.length == 1 for chunk in chunks) and not any(self._touches_span(c) for c in chunks):
            return self.prepare_decode(chunks)
        tokens: list[int] = []
        q_ranges: list[tuple[int, int]] = []
        full_write, swa_slots, swa_write, swa_first = [], [], [], []
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.length
            tokens.extend(seq.token_slice(start, end))
            q_ranges.append((start, chunk.length))
            view = seq.view
            full_write.append(page_slots(view.full_pages, 0, view.full_page_size, start, end))
            first = max(0, start - self.window + 1)
            swa_first.append(first)
            swa_slots.append(torch.tensor(view.swa_slots(first, end), dtype=torch.int64))
            swa_write.append(swa_slots[-1][start - first :])
        rows = self.block_table.sync([(chunk.seq.request_id, chunk.seq.view) for chunk in chunks])
        full_batch = PagedBatch.from_block_table(q_ranges, self.block_table.table, rows, torch.cat(full_write),
                                                 self.allocator.full.page_size, self.device)
        swa_batch = PagedBatch.build(q_ranges, swa_slots, swa_first, swa_write, self.device)
        backend = PagedAttentionBackend(self.kv, full_batch, swa_batch, self.attention_fn)
        input_ids = to_device(torch.tensor(tokens, dtype=torch.long), self.device)
        inputs_embeds = self._embed_with_spans(chunks, input_ids) if self._spans else None
        return StepInputs(input_ids, full_batch.q_pos, backend, inputs_embeds)

    def prepare_decode(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """A step of one query per request, as a ``DecodeBatch``: O(batch x W) on
        the host, one host-to-device copy, full-pool pages gathered from the
        device block table."""
        window, rows = self.window, []
        for chunk in chunks:
            seq, pos = chunk.seq, chunk.start
            view = seq.view
            page = view.full_page_size
            swa = view.swa_slots(max(0, pos + 1 - window), pos + 1)
            rows.append([seq.token_slice(pos, pos + 1)[0], pos, view.full_pages[pos // page] * page + pos % page,
                         len(swa), swa[-1], *swa, *([0] * (window - len(swa)))])
        table_rows = self.block_table.sync([(chunk.seq.request_id, chunk.seq.view) for chunk in chunks])
        for row, table_row in zip(rows, table_rows):
            row.append(table_row)
        meta = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        # Fields as tensors of their own (not views at offsets of one), so the
        # compiled forward sees the same strides and offsets at every step.
        ids, positions, full_write, swa_len, swa_write = (meta[:, i].clone() for i in range(5))
        widest = -(-(max(chunk.start for chunk in chunks) + 1) // self.allocator.full.page_size)
        batch = DecodeBatch(
            positions=positions,
            full_pages=self.block_table.table[meta[:, -1], :widest],
            full_write=full_write,
            swa_slots=meta[:, 5:-1].clone(),
            swa_len=swa_len,
            swa_write=swa_write,
            page_size=self.allocator.full.page_size,
        )
        backend = DecodeAttentionBackend(self.kv, batch, self.decode_attention_fn)
        return StepInputs(ids, positions, backend, None)

    def _touches_span(self, chunk: ScheduledChunk) -> bool:
        start, end = chunk.start, chunk.start + chunk.length
        return any(span.offset < end and start < span.end for span in self._spans.get(chunk.seq.request_id, ()))

    def _embed_with_spans(self, chunks: list[ScheduledChunk], input_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings of the batch with every span position's row taken
        from its span, or None when no chunk touches a span.

        A chunk may start or end inside a span (chunked prefill, a cache hit,
        recompute after preemption): only the overlapping rows are copied.
        """
        placements: list[tuple[int, torch.Tensor]] = []  # (batch row, span rows)
        row = 0
        for chunk in chunks:
            start, end = chunk.start, chunk.start + chunk.length
            for span in self._spans.get(chunk.seq.request_id, ()):
                lo, hi = max(start, span.offset), min(end, span.end)
                if lo < hi:
                    placements.append((row + lo - start, span.embeddings[lo - span.offset : hi - span.offset]))
            row += chunk.length
        if not placements:
            return None
        # Span positions hold negative cache tokens; any valid id does for the
        # lookup, as those rows are overwritten below.
        embeds = self.model.model.embed_tokens(input_ids.clamp_(min=0))
        for first, rows in placements:
            embeds[first : first + rows.shape[0]] = rows
        return embeds

    def _accept(self, seq: Sequence, token: int) -> TokenEvent:
        sampling = self._sampling[seq.request_id]
        seq.output.append(token)
        reason = None
        if token in sampling.stop_ids:
            reason = "stop"
        elif len(seq.output) >= seq.max_tokens:
            reason = "length"
        if reason is not None:
            self._end(seq, reason)
        return TokenEvent(seq.request_id, token, reason)

    def _end(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.block_table.release(seq.request_id)
        del self._sampling[seq.request_id]
        del self._sequences[seq.request_id]
        self._spans.pop(seq.request_id, None)

    def flush_cache(self) -> None:
        """Drop every cached prefix no running request holds."""
        if self.cache is not None:
            self.cache.flush()

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        full, swa = self.allocator.full, self.allocator.swa
        cache = self.cache.stats if self.cache is not None else None
        return {
            "prefix_cache": None if cache is None else {
                "cached_prompt_tokens": cache.cached_prompt_tokens,
                "computed_prompt_tokens": cache.computed_prompt_tokens,
                "hit_rate": round(cache.hit_rate, 4),
                "nodes": self.cache.num_nodes,  # type: ignore[union-attr]
                "swa_slots_cached": self.cache.swa_slots_cached,  # type: ignore[union-attr]
            },
            "swa_mode": self.config.swa_mode,
            "full_pool": {
                "capacity_tokens": full.capacity,
                "free_tokens": full.free_slots,
                "bytes_per_token": self.kv.full_bytes_per_token,
            },
            "swa_pool": {
                "capacity_tokens": swa.capacity,
                "free_tokens": swa.free_slots,
                "bytes_per_token": self.kv.swa_bytes_per_token,
            },
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
        }
