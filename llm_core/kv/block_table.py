"""Per-request full-pool page tables on the engine's device, kept up to date by
appending, so a step's attention metadata costs O(batch), not O(context).

Each request the engine runs owns one row of a [rows, width] int32 tensor
holding its full-pool page ids in position order. A step copies only the page
ids that changed since the last one (``SequenceView.full_pages_synced``): one
new page every ``page_size`` decode steps, a chunk's pages on prefill, the
whole row after a prefix-cache attach or a preemption. Kernels read key ``i``
of a request from slot ``table[row, i // page_size] * page_size + i % page_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_core.kv.kv_pool import SequenceView
from llm_core.device import to_device

__all__ = ["BlockTable"]


class BlockTable:
    def __init__(self, width: int, device: torch.device | str, rows: int = 64) -> None:
        """``width``: the most full pages one request can hold."""
        if width < 1 or rows < 1:
            raise ValueError(f"a block table needs positive rows and width, got {rows} x {width}")
        self.width = width
        self.device = torch.device(device)
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    @property
    def rows_in_use(self) -> int:
        return len(self._row_of)

    def sync(self, requests: Sequence[tuple[int, SequenceView]]) -> list[int]:
        """The row of every (request id, view), after copying the page ids that
        changed since the last sync to the device in one scatter."""
        rows: list[int] = []
        update_rows: list[int] = []
        update_cols: list[int] = []
        update_pages: list[int] = []
        for request_id, view in requests:
            row = self._row_of.get(request_id)
            if row is None:
                row = self._assign(request_id)
                view.rewrote_full_pages(0)  # a fresh row holds nothing of this request yet
            rows.append(row)
            first, pages = view.full_pages_synced, view.full_pages
            if first == len(pages):
                continue
            if len(pages) > self.width:
                raise ValueError(f"request {request_id} holds {len(pages)} full pages, the table {self.width}")
            update_rows += [row] * (len(pages) - first)
            update_cols += range(first, len(pages))
            update_pages += pages[first:]
            view.full_pages_synced = len(pages)
        if update_pages:
            self.table[_on(update_rows, self.device), _on(update_cols, self.device)] = _on(
                update_pages, self.device, torch.int32
            )
        return rows

    def release(self, request_id: int) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _assign(self, request_id: int) -> int:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._row_of[request_id] = row
        return row

    def _grow(self) -> None:
        # Rows outlive running (a preempted request keeps its row while it waits):
        # double instead of refusing. Rare, so the copy does not matter.
        old = self.table.shape[0]
        table = torch.zeros(2 * old, self.width, dtype=torch.int32, device=self.device)
        table[:old] = self.table
        self.table = table
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))


def _on(values: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)
