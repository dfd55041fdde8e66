"""The engine's device block table: appended, never rebuilt, and always equal to
every running request's full pages (prefix-cache hits, page dedupe on insert,
preemption and recompute included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_core import LLM, SamplingParams
from llm_core.kv.block_table import BlockTable
from llm_core.kv.kv_pool import SequenceView


def _view(pages: list[int]) -> SequenceView:
    return SequenceView(4, full_pages=list(pages))


def test_only_changed_pages_are_copied() -> None:
    table = BlockTable(width=8, device="cpu", rows=2)
    a, b = _view([5, 6]), _view([9])
    rows = table.sync([(1, a), (2, b)])
    assert table.table[rows[0], :2].tolist() == [5, 6] and table.table[rows[1], :1].tolist() == [9]
    a.full_pages.append(7)
    table.table[rows[0], :2] = -1  # untouched entries are not rewritten: they stay as they are
    assert table.sync([(1, a)]) == [rows[0]]
    assert table.table[rows[0], :3].tolist() == [-1, -1, 7]
    a.full_pages[0] = 11
    a.rewrote_full_pages(0)
    table.sync([(1, a)])
    assert table.table[rows[0], :3].tolist() == [11, 6, 7]


def test_rows_are_reused_and_the_table_grows() -> None:
    table = BlockTable(width=4, device="cpu", rows=1)
    first = table.sync([(1, _view([1]))])[0]
    table.release(1)
    assert table.sync([(2, _view([2]))])[0] == first  # a freed row is reused (and fully rewritten)
    rows = table.sync([(3, _view([3])), (4, _view([4]))])
    assert len({first, *rows}) == 3 and table.table.shape[0] >= 3
    assert [table.table[r, 0].item() for r in (first, *rows)] == [2, 3, 4]
    with pytest.raises(ValueError, match="full pages"):
        table.sync([(5, _view(list(range(5))))])


def _check_table(llm: LLM) -> int:
    engine = llm.engine
    checked = 0
    for seq in engine.scheduler.running:
        row = engine.block_table._row_of.get(seq.request_id)
        if row is None or seq.view.full_pages_synced != len(seq.view.full_pages):
            continue  # not yet synced since its last change: the next forward syncs it first
        pages = seq.view.full_pages
        assert engine.block_table.table[row, : len(pages)].tolist() == pages
        checked += 1
    return checked


@pytest.mark.parametrize("caching", [True, False])
def test_table_matches_every_running_view_step_by_step(tiny_checkpoint: Path, caching: bool) -> None:
    # A small pool forces preemption; shared prefixes make cache hits and page dedupe.
    llm = LLM(tiny_checkpoint, kv_budget_bytes=512 << 10, page_size=4, chunked_prefill_size=8, max_running_requests=4,
              enable_prefix_caching=caching, checkpoint_interval=8)
    reference = LLM(tiny_checkpoint, enable_prefix_caching=False)
    shared = list(range(20, 52))
    prompts = [shared + list(range(60 + i, 64 + 3 * i)) for i in range(6)] + [list(range(5, 40))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    for round_ in range(2):  # the second round hits what the first cached
        ids = [llm.add_request(p, params) for p in prompts]
        out: dict[int, list[int]] = {i: [] for i in ids}
        checked = 0
        with torch.inference_mode():
            while llm.engine.has_unfinished():
                for event in llm.engine.step():
                    out[event.request_id].append(event.token)
                checked += _check_table(llm)
        assert [out[i] for i in ids] == expected
        assert checked > 0
    assert llm.engine.block_table.rows_in_use == 0
    if caching:
        assert llm.stats()["prefix_cache"]["cached_prompt_tokens"] > 0
    assert llm.stats()["preemptions"] > 0
