"""CUDA graphs of the decode forward, one per padded batch size.

A decode step launches a few hundred small kernels; replaying them from a
graph removes the launch cost, which is most of a decode step at small
batches. Every graph reads its inputs from one set of static buffers sized
for the largest batch (a batch of ``b`` uses their first ``b`` rows), so a
step copies its ``DecodeBatch`` in, pads the rows up to the next captured
size, replays and reads the logits of its own rows.

Padding rows are harmless requests of one token at position 0: they write
their K/V to the pools' scratch page and slot (never handed out by the
allocator) and attend to that one key only. The full-pool page table is
captured at its full width; the Triton kernel reads only each request's
``kv_len`` keys, so the width costs nothing per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from llm_core.kv.paged_attention import DecodeBatch, KVCacheTensors

DecodeForward = Callable[[torch.Tensor, DecodeBatch], torch.Tensor]

__all__ = ["DecodeGraphs", "graph_batch_sizes"]


def graph_batch_sizes(limit: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8, up to and including ``limit``."""
    if limit < 1:
        raise ValueError(f"need a positive batch limit, got {limit}")
    sizes = {b for b in (1, 2, 4) if b <= limit} | set(range(8, limit + 1, 8)) | {limit}
    return tuple(sorted(sizes))


def padded_size(sizes: Sequence[int], n: int) -> int:
    """The smallest captured size that holds ``n`` requests."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"no graph holds {n} requests (largest: {sizes[-1]})")


class DecodeGraphs:
    def __init__(
        self,
        forward: DecodeForward,
        kv: KVCacheTensors,
        batch_sizes: Sequence[int],
        table_width: int,
        window: int,
        device: torch.device,
    ) -> None:
        self.sizes = tuple(sorted(batch_sizes))
        self.max_batch = self.sizes[-1]
        n, page = self.max_batch, kv.page_size
        self._scratch_page = kv.full_scratch_page
        self._scratch_slot = kv.swa_scratch_slot

        def i64(fill: int, *shape: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        self._ids = i64(0, n)
        self._batch = DecodeBatch(
            positions=i64(0, n),
            full_pages=torch.full((n, table_width), kv.full_scratch_page, dtype=torch.int32, device=device),
            full_write=i64(kv.full_scratch_page * page, n),
            swa_slots=i64(kv.swa_scratch_slot, n, window),
            swa_len=i64(1, n),
            swa_write=i64(kv.swa_scratch_slot, n),
            page_size=page,
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs then fit in the memory it reserved.
        for size in reversed(self.sizes):
            self._capture(forward, size, pool, device)

    def _rows(self, b: int) -> DecodeBatch:
        s = self._batch
        return DecodeBatch(s.positions[:b], s.full_pages[:b], s.full_write[:b], s.swa_slots[:b], s.swa_len[:b],
                           s.swa_write[:b], s.page_size)

    @torch.inference_mode()  # as engine steps run
    def _capture(self, forward: DecodeForward, size: int, pool: tuple[int, int], device: torch.device) -> None:
        batch = self._rows(size)
        # Warm-up off the capture stream: Triton compiles, torch.compile traces,
        # the allocator settles, none of which may happen inside a capture.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward(self._ids[:size], batch)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._logits[size] = forward(self._ids[:size], batch)
        self._graphs[size] = graph

    def replay(self, input_ids: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """Logits [n, vocab] of the step's n requests; valid until the next replay."""
        n = input_ids.shape[0]
        size = padded_size(self.sizes, n)
        s = self._batch
        self._ids[:n].copy_(input_ids)
        s.positions[:n].copy_(batch.positions)
        s.full_pages[:n, : batch.full_pages.shape[1]].copy_(batch.full_pages)
        s.full_write[:n].copy_(batch.full_write)
        s.swa_slots[:n].copy_(batch.swa_slots)
        s.swa_len[:n].copy_(batch.swa_len)
        s.swa_write[:n].copy_(batch.swa_write)
        if size > n:  # rows a larger batch left behind become padding again
            s.positions[n:size].zero_()
            s.full_pages[n:size, 0].fill_(self._scratch_page)
            s.full_write[n:size].fill_(self._scratch_page * s.page_size)
            s.swa_slots[n:size, 0].fill_(self._scratch_slot)
            s.swa_len[n:size].fill_(1)
            s.swa_write[n:size].fill_(self._scratch_slot)
        self._graphs[size].replay()
        return self._logits[size][:n]
