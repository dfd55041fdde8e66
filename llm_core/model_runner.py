"""The model runner: a step's chunks in, logits out. It builds the forward's
inputs from the scheduled chunks (block table, SWA slots, drafts, media
rows), and owns how the forward runs: eager, compiled, or replayed from a
CUDA graph, with the KV tiers' restores finished before it reads them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from llm_core.kv.attention_backends import DecodeAttentionBackend, PagedAttentionBackend
from llm_core.kv.block_table import BlockTable
from llm_core.cuda_graphs import DecodeGraphs, graph_batch_sizes
from llm_core.device import column, to_device
from llm_core.engine_config import AttentionImpl, EngineConfig
from llm_core.kv.kv_pool import KVAllocator
from llm_core.kv.tiers.kv_transfer import EngineTierIO
from llm_core.model.model import MiMoV2ForCausalLM
from llm_core.kv.paged_attention import (
    AttentionFn,
    DecodeAttentionFn,
    DecodeBatch,
    KVCacheTensors,
    PagedBatch,
    paged_attention_torch,
    paged_decode_attention_torch,
)
from llm_core.request import Request
from llm_core.sched.scheduler import ScheduledChunk

__all__ = ["DecodeForwardFn", "ModelRunner", "StepInputs", "compiled", "compiled_decode_logits", "decode_logits",
           "extend_hidden", "page_slots", "resolve_attention", "resolve_decode_attention", "sample_rows",
           "uses_triton"]

DecodeForwardFn = Callable[[MiMoV2ForCausalLM, torch.Tensor, torch.Tensor, DecodeAttentionBackend], torch.Tensor]


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    backend: PagedAttentionBackend | DecodeAttentionBackend
    inputs_embeds: torch.Tensor | None




def page_slots(pages: list[int], base_page: int, page_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of positions [start, end) given the physical pages of logical
    pages base_page, base_page + 1, ... (vectorised: sequences are long)."""
    first_page = start // page_size
    used = torch.tensor(pages[first_page - base_page : -(-end // page_size) - base_page], dtype=torch.int64)
    slots = (used[:, None] * page_size + torch.arange(page_size)).flatten()
    offset = start - first_page * page_size
    return slots[offset : offset + end - start]


def sample_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """Batch rows whose hidden state gives a next token: each sampling chunk's
    last known token and its drafts."""
    rows, offset = [], 0
    for chunk in chunks:
        if chunk.samples:
            rows.extend(range(offset + chunk.length - 1, offset + chunk.rows))
        offset += chunk.rows
    return rows

def uses_triton(impl: AttentionImpl, device: torch.device) -> bool:
    return impl == "triton" or (impl == "auto" and device.type == "cuda")


def resolve_attention(impl: AttentionImpl, device: torch.device) -> AttentionFn:
    if uses_triton(impl, device):
        from llm_core.kv.triton_attention import paged_attention_triton

        return paged_attention_triton
    if impl == "auto" and device.type == "cpu":
        from llm_core.kv import cpu_kernels
        if cpu_kernels.available():
            return cpu_kernels.paged_attention_cpu
    return paged_attention_torch


def resolve_decode_attention(impl: AttentionImpl, device: torch.device) -> DecodeAttentionFn:
    if uses_triton(impl, device):
        from llm_core.kv.triton_attention import paged_decode_attention_triton

        return paged_decode_attention_triton
    if impl == "auto" and device.type == "cpu":
        from llm_core.kv import cpu_kernels
        if cpu_kernels.available():
            return cpu_kernels.paged_decode_attention_cpu
    return paged_decode_attention_torch


def decode_logits(model: MiMoV2ForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  backend: DecodeAttentionBackend) -> torch.Tensor:
    """The decode forward, logits included: what is compiled and captured."""
    hidden = model(input_ids, positions, backend)
    backend.store_hidden(hidden)
    return model.compute_logits(hidden)


def extend_hidden(model: MiMoV2ForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  backend: PagedAttentionBackend, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
    """The forward of a step with prefill chunks: final hidden states."""
    hidden = model(input_ids, positions, backend, inputs_embeds=inputs_embeds)
    backend.store_hidden(hidden)
    return hidden


def compiled(fn: Callable[..., torch.Tensor], device: torch.device,
             backend: str = "inductor") -> Callable[..., torch.Tensor]:
    """``fn`` under torch.compile(fullgraph=True) with dynamic shapes: one graph
    for every batch size and context (a decode batch of one aside: inductor's
    broadcasting checks still tell a size of 1 from larger ones there)."""
    # On CPU, inductor's C++ wrapper: a graph's calls run without Python in
    # between (decode 10-15% faster on the tiny model), and its kernels build
    # as one library per graph rather than one per kernel (a quarter less
    # compiler CPU in a cold warm-up).
    options = {"cpp_wrapper": True} if backend == "inductor" and device.type == "cpu" else None
    graph = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend, options=options)
    # Without duck sizing, two sizes that happen to be equal when a graph is
    # traced (batch and page count, say) are not assumed equal forever,
    # which would recompile it when they part.
    # Size-oblivious sizes: a size of 1 takes the general graph rather than
    # one traced for it (one row, one sequence, one request), which cuts the
    # warm-up's compiles by a quarter; broadcasting checks that must tell 1
    # apart still guard (a decode batch of one keeps its own graph), and
    # tests/llm_core/test_warmup.py checks compiled against eager tokens.
    # One graph per MTP layer module as well: more than dynamo's default of 8.
    # Float attributes (norm eps, scales) are constants of the graph: each
    # would otherwise be a symbolic input guarded in Python at every call.
    # Made once and entered at each call (a patch restores what it changed on
    # exit): building them anew cost 30 us a call, 3% of a one-row decode step.
    shapes = torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True)
    limits = torch._dynamo.config.patch(recompile_limit=64, specialize_float=True)

    def run(*args: Any) -> torch.Tensor:
        with shapes, limits:
            return graph(*args)

    return run


def compiled_decode_logits(device: torch.device, backend: str = "inductor") -> DecodeForwardFn:
    return compiled(decode_logits, device, backend)


class ModelRunner:
    def __init__(self, model: MiMoV2ForCausalLM, kv: KVCacheTensors, allocator: KVAllocator,
                 block_table: BlockTable, window: int, config: EngineConfig, device: torch.device,
                 requests: Mapping[int, Request], tier_io: EngineTierIO | None) -> None:
        """``requests``: the engine's live requests (read for their spans and
        drafts); ``tier_io``: the KV tiers' copies, whose restores a forward waits for."""
        self.model = model
        self.kv = kv
        self.allocator = allocator
        self.block_table = block_table
        self.window = window
        self.config = config
        self.device = device
        self.requests = requests
        self.tier_io = tier_io
        self.attention_fn = resolve_attention(config.attention, device)
        self.decode_attention_fn = resolve_decode_attention(config.attention, device)
        if config.compile:
            kv.mark_static()
        self._decode_logits = compiled_decode_logits(device) if config.compile else decode_logits
        self._extend_hidden = compiled(extend_hidden, device) if config.compile else extend_hidden
        self.graphs = self._capture_graphs()

    def logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Logits of every chunk that samples, in chunk order; None if none does."""
        rows = sample_rows(chunks)
        step = self.prepare_step(chunks)
        try:
            if isinstance(step.backend, DecodeAttentionBackend):
                self.finish_restores()
                # One row per chunk: the graphs and the compiled forward compute them all.
                logits = self._decode_step(step)
                return logits if len(rows) == logits.shape[0] else (logits[rows] if rows else None)
            if step.backend.before_layer is None:
                self.finish_restores()
            hidden = self._extend_hidden(self.model, step.input_ids, step.positions, step.backend,
                                         step.inputs_embeds)
            return self.model.compute_logits(hidden[rows]) if rows else None
        finally:
            self.finish_restores()  # nothing runs past a step with a restore still on its way

    def finish_restores(self) -> None:
        if self.tier_io is not None:
            self.tier_io.finish_restores()

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
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.rows
            tokens.extend(seq.token_slice(start, start + chunk.length))
            tokens.extend([0] * chunk.drafts)
            q_ranges.append((start, chunk.rows))
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
        # A compiled forward cannot wait layer by layer: restores finish before it.
        gate = self.tier_io.restore_gate() if self.tier_io is not None and not self.config.compile else None
        backend = PagedAttentionBackend(self.kv, full_batch, swa_batch, self.attention_fn, before_layer=gate)
        input_ids = self._with_drafts(chunks, to_device(torch.tensor(tokens, dtype=torch.long), self.device))
        inputs_embeds = self._embed_with_spans(chunks, input_ids)
        if inputs_embeds is None and self.config.compile:
            # A compiled extend always takes embeddings: one graph whether or not a batch has media rows.
            inputs_embeds = self.model.model.embed_tokens(input_ids)
        return StepInputs(input_ids, full_batch.q_pos, backend, inputs_embeds)

    def prepare_decode(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """A step of one query per request, as a ``DecodeBatch``: O(batch x W) on
        the host, one host-to-device copy, full-pool pages gathered from the
        device block table."""
        window, rows = self.window, []
        table_rows = self.block_table.sync([(chunk.seq.request_id, chunk.seq.view) for chunk in chunks])
        for chunk, table_row in zip(chunks, table_rows):
            seq = chunk.seq
            view = seq.view
            page = view.full_page_size
            token = seq.token_slice(chunk.start, chunk.start + 1)[0]
            # A verify chunk's rows are queries of their own (drafts filled in below).
            for pos in range(chunk.start, chunk.start + chunk.rows):
                swa = view.swa_slots(max(0, pos + 1 - window), pos + 1)
                rows.append([token if pos == chunk.start else 0, pos,
                             view.full_pages[pos // page] * page + pos % page,
                             len(swa), swa[-1], *swa, *([0] * (window - len(swa))), table_row])
        meta = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        # Fields as tensors of their own (not views at offsets of one), so the
        # compiled forward sees the same strides and offsets at every step.
        ids, positions, full_write, swa_len, swa_write = (column(meta, i) for i in range(5))
        ids = self._with_drafts(chunks, ids)
        widest = -(-max(chunk.start + chunk.rows for chunk in chunks) // self.allocator.full.page_size)
        # At least two page columns (the kernels read only a request's own
        # pages): a width of 1 would be a compiled graph of its own.
        widest = max(widest, min(2, self.block_table.width))
        batch = DecodeBatch(
            positions=positions,
            full_pages=self.block_table.table[meta[:, -1], :widest],
            full_write=full_write,
            swa_slots=meta[:, 5:-1].clone(memory_format=torch.contiguous_format),
            swa_len=swa_len,
            swa_write=swa_write,
            page_size=self.allocator.full.page_size,
        )
        backend = DecodeAttentionBackend(self.kv, batch, self.decode_attention_fn)
        return StepInputs(ids, positions, backend, None)

    def _with_drafts(self, chunks: list[ScheduledChunk], ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with each verify chunk's draft rows set to its drafts (on the
        device: drafts are never copied to the host before they are verified)."""
        rows, drafts, offset = [], [], 0
        for chunk in chunks:
            if chunk.drafts:
                rows.extend(range(offset + chunk.length, offset + chunk.rows))
                pending = self.requests[chunk.seq.request_id].drafts
                assert pending is not None, "a verify chunk without drafts"
                drafts.append(pending[0][: chunk.drafts])
            offset += chunk.rows
        if rows:
            ids[to_device(torch.tensor(rows), self.device)] = torch.cat(drafts)
        return ids

    def _touches_span(self, chunk: ScheduledChunk) -> bool:
        return self.requests[chunk.seq.request_id].touches_span(chunk.start, chunk.start + chunk.length)

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
            for span in self.requests[chunk.seq.request_id].spans:
                lo, hi = max(start, span.offset), min(end, span.end)
                if lo < hi:
                    placements.append((row + lo - start, span.embeddings[lo - span.offset : hi - span.offset]))
            row += chunk.rows
        if not placements:
            return None
        # Span positions hold negative cache tokens; any valid id does for the
        # lookup, as those rows are overwritten below.
        embeds = self.model.model.embed_tokens(input_ids.clamp_(min=0))
        for first, rows in placements:
            embeds[first : first + rows.shape[0]] = rows
        return embeds
