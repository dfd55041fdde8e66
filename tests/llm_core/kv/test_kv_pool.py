"""Pool bookkeeping without a model."""

from __future__ import annotations

import pytest
import torch

from llm_core.model_runner import page_slots
from llm_core.kv.kv_pool import FullKVPool, KVAllocator, PoolSizing, SWAKVPool
from llm_core.kv.paged_attention import KVCacheTensors
from llm_core.model.presets import mimo_v2_flash


def _allocator(window: int = 9, full_pages: int = 64, swa_slots: int = 64, mode: str = "hybrid") -> KVAllocator:
    return KVAllocator(FullKVPool(full_pages, 4), SWAKVPool(swa_slots, 1), window, mode)  # type: ignore[arg-type]


def test_full_slots_grow_and_swa_slots_stay_within_the_window() -> None:
    alloc = _allocator(window=9)  # W = 8, pages of 4
    view = alloc.new_view()
    peak = 0
    for pos in range(100):  # one token at a time, as in decode
        alloc.grow(view, pos + 1)
        peak = max(peak, view.swa_slots_held)
        alloc.release_out_of_window(view, pos + 1)
        # The W tokens before the last page boundary onward: at most W + page - 1.
        assert 8 <= view.swa_slots_held <= 8 + 3 or pos < 8
        assert view.swa_base == max(0, ((pos + 1) // 4 * 4 - 8))
    assert peak == 8 + 4  # W + page, the token being computed included
    assert len(view.full_pages) == 25
    # Positions map to distinct slots; the live window is addressable.
    assert len(set(page_slots(view.full_pages, 0, 4, 0, 100).tolist())) == 100
    assert len(view.swa_slots(92, 100)) == 8
    with pytest.raises(KeyError):
        view.swa_slots(80, 100)


def test_chunked_prefill_holds_window_plus_chunk() -> None:
    alloc = _allocator(window=9, full_pages=128, swa_slots=200)
    view = alloc.new_view()
    for end in range(32, 321, 32):
        alloc.grow(view, end)
        assert view.swa_slots_held <= 8 + 32 + 4
        alloc.release_out_of_window(view, end)


def test_free_returns_everything_and_full_mode_keeps_swa() -> None:
    for mode in ("hybrid", "full"):
        alloc = _allocator(mode=mode, swa_slots=256)
        views = [alloc.new_view() for _ in range(3)]
        for v in views:
            alloc.grow(v, 50)
            alloc.release_out_of_window(v, 50)
        held = sum(v.swa_slots_held for v in views)
        # Hybrid keeps the W=8 tokens before the last page boundary (48) onward.
        assert held == (3 * 50 if mode == "full" else 3 * 10)
        for v in views:
            alloc.free(v)
        assert alloc.full.free_slots == alloc.full.capacity
        assert alloc.swa.free_slots == alloc.swa.capacity


def test_grow_refuses_when_a_pool_is_exhausted() -> None:
    alloc = _allocator(full_pages=5, swa_slots=12)
    view = alloc.new_view()
    assert not alloc.can_grow(view, 21)  # 6 pages of 4
    assert not alloc.can_grow(view, 13)  # 13 SWA slots
    with pytest.raises(MemoryError):
        alloc.grow(view, 21)
    alloc.grow(view, 12)
    assert alloc.swa.free_slots == 0
    alloc.release_out_of_window(view, 12)  # keeps positions 4.. (W=8 before the page at 12)
    assert alloc.swa.free_slots == 4
    assert alloc.can_grow(view, 16) and not alloc.can_grow(view, 17)


def test_truncate_rolls_back_positions() -> None:
    alloc = _allocator()
    view = alloc.new_view()
    alloc.grow(view, 20)
    alloc.truncate(view, 13)
    assert view.num_tokens == 13 and len(view.full_pages) == 4
    alloc.grow(view, 14)
    assert view.num_tokens == 14


def test_sizing_and_meta_tensors_for_a_model_that_does_not_fit() -> None:
    config = mimo_v2_flash()
    tensors = KVCacheTensors(config, 1 << 20, 1 << 16, torch.bfloat16, "meta")
    assert tensors.device.type == "meta" and tensors.layer(0)[1].device.type == "meta"
    # 9 full layers x 4 KV heads x (192 + 128) x 2 bytes; 39 SWA + 3 MTP layers x 8 heads.
    assert tensors.full_bytes_per_token == 9 * 4 * 320 * 2
    assert tensors.swa_bytes_per_token == 42 * 8 * 320 * 2
    sizing = PoolSizing.from_budget(80 << 30, tensors.full_bytes_per_token, tensors.swa_bytes_per_token,
                                    129, 16, 64, 8192)
    assert sizing.swa_tokens == 64 * 129 + 8192
    used = sizing.full_tokens * tensors.full_bytes_per_token + sizing.swa_tokens * tensors.swa_bytes_per_token
    assert (80 << 30) - 16 * tensors.full_bytes_per_token <= used <= 80 << 30
