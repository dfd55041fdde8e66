"""Paged-attention batches for kernel tests: random pools whose keys sit in
shuffled slots (NaN elsewhere), addressed by slot lists or a block table."""

from __future__ import annotations

import random

import torch

from llm_core.kv.paged_attention import PagedBatch

# (first key position, first query position, number of queries) per request.
# Keys run from the first key position to the last query position.
MIXED = [
    (0, 20, 1),  # decode with 20 keys of history
    (0, 12, 5),  # chunk of 5 after a 12-token prefix
    (0, 0, 37),  # fresh prefill
    (0, 30, 37),  # chunk of 37 after 30 tokens: windows start mid-way
    (22, 30, 37),  # same, keys trimmed to the window of 9 (as SWA pools keep them)
    (3, 11, 1),  # decode whose keys start mid-way
]
DECODE = [(0, 0, 1), (0, 7, 1), (5, 13, 1), (0, 40, 1), (32, 40, 1)]


def make_case(
    requests: list[tuple[int, int, int]],
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    dtype: torch.dtype,
    with_sinks: bool,
    device: str,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch, torch.Tensor | None]:
    """Random pools whose keys sit in scattered, shuffled slots; unused slots
    hold NaN so reading a wrong slot shows up in the output."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [q0 + n - k0 for k0, q0, n in requests]
    n_slots = sum(kv_lens) + 17
    free = list(range(n_slots))
    rng.shuffle(free)
    kv_slot_lists, write_slot_lists = [], []
    for (_, _, n), kv_len in zip(requests, kv_lens):
        slots, free = free[:kv_len], free[kv_len:]
        kv_slot_lists.append(slots)
        write_slot_lists.append(slots[-n:])
    batch = PagedBatch.build(
        [(q0, n) for _, q0, n in requests],
        kv_slot_lists,
        [k0 for k0, _, _ in requests],
        write_slot_lists,
        device,
    )
    k_cache = torch.full((n_slots, hkv, d), float("nan"))
    v_cache = torch.full((n_slots, hkv, dv), float("nan"))
    used = batch.kv_table.cpu()
    k_cache[used] = torch.randn(len(used), hkv, d, generator=gen)
    v_cache[used] = torch.randn(len(used), hkv, dv, generator=gen)
    q = torch.randn(sum(n for _, _, n in requests), hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None

    def to(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype)

    return to(q), to(k_cache), to(v_cache), batch, None if sinks is None else sinks.to(device)


def make_block_table_case(
    requests: list[tuple[int, int]], page_size: int, device: str, seed: int = 0
) -> tuple[PagedBatch, PagedBatch, int]:
    """The same keys addressed two ways: through a [rows, width] block table of
    shuffled pages (full layers), and as explicit slot lists. requests: (first
    query position, number of queries); keys start at position 0."""
    rng = random.Random(seed)
    width = max(-(-(q0 + n) // page_size) for q0, n in requests) + 1
    n_pages = sum(-(-(q0 + n) // page_size) for q0, n in requests) + 3
    free_pages = list(range(n_pages))
    rng.shuffle(free_pages)
    table = torch.zeros(len(requests) + 2, width, dtype=torch.int32)
    rows = rng.sample(range(table.shape[0]), len(requests))
    slot_lists, writes = [], []
    for (q0, n), row in zip(requests, rows):
        used = -(-(q0 + n) // page_size)
        pages, free_pages = free_pages[:used], free_pages[used:]
        table[row, :used] = torch.tensor(pages, dtype=torch.int32)
        slots = [pages[i // page_size] * page_size + i % page_size for i in range(q0 + n)]
        slot_lists.append(slots)
        writes.append(slots[q0:])
    q_ranges = list(requests)
    write_slots = torch.tensor([s for w in writes for s in w], dtype=torch.int64)
    paged = PagedBatch.from_block_table(q_ranges, table.to(device), rows, write_slots, page_size, device)
    listed = PagedBatch.build(q_ranges, slot_lists, [0] * len(requests), writes, device)
    return paged, listed, n_pages * page_size
