"""Prefill/decode disaggregation in the engine: a request prefilled by one
engine and decoded by another, its KV handed over as one packed transfer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_core import LLM, SamplingParams
from llm_core.cluster.disagg import PrefilledKV, plan_for_config, plan_transfer
from llm_core.kv.kv_pool import FullKVPool, KVAllocator, SWAKVPool
from llm_core.model.presets import PRESETS
from tests.conftest import REF_WINDOW, assert_pools_full, hf_greedy_outputs

PAGE = 4
OPTIONS = {"page_size": PAGE, "chunked_prefill_size": 16, "kv_budget_bytes": 1 << 20, "max_running_requests": 4}


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (length + 7 * i,), generator=gen).tolist() for i in range(n)]


def prefill(llm: LLM, prompt: list[int], params: SamplingParams) -> PrefilledKV:
    """Run one exporting request on the prefill engine up to its handover."""
    rid = llm.add_request(prompt, params, export_kv=True)
    events = []
    while llm.engine.has_unfinished():
        events += [e for e in llm.step() if e.request_id == rid]
    assert [e.finish_reason for e in events] == ["prefilled"]
    exported = llm.take_export(rid)
    assert exported is not None and exported.first_token == events[0].token
    return exported


def disaggregated(prefill_llm: LLM, decode_llm: LLM, batch: list[list[int]],
                  params: SamplingParams) -> list[list[int]]:
    """Every prompt prefilled on one engine, then all decoded together on the other."""
    outputs: dict[int, list[int]] = {}
    for prompt in batch:
        reservation = decode_llm.reserve_kv(len(prompt), params.max_tokens)
        assert reservation is not None
        exported = prefill(prefill_llm, prompt, params)
        decode_llm.fill_reservation(reservation, exported.blob)
        outputs[decode_llm.add_prefilled(reservation, prompt, params, exported)] = []
    while decode_llm.engine.has_unfinished():
        for event in decode_llm.step():
            outputs[event.request_id].append(event.token)
    return list(outputs.values())


@pytest.mark.parametrize("speculative_tokens", [0, None])
def test_prefill_on_one_engine_and_decode_on_another_match_transformers(
        hf_checkpoint: Path, hf_model, speculative_tokens: int | None) -> None:  # noqa: ANN001
    batch = prompts(3, 30)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prefill_llm = LLM(hf_checkpoint, speculative_tokens=speculative_tokens, **OPTIONS)
    decode_llm = LLM(hf_checkpoint, speculative_tokens=speculative_tokens, **OPTIONS)
    assert disaggregated(prefill_llm, decode_llm, batch, params) == hf_greedy_outputs(hf_model, batch, 12)
    assert_pools_full(prefill_llm)
    assert_pools_full(decode_llm)


def test_the_transfer_holds_every_full_position_and_only_the_live_window(hf_checkpoint: Path) -> None:
    prefill_llm = LLM(hf_checkpoint, **OPTIONS)
    prompt = prompts(1, 37)[0]
    exported = prefill(prefill_llm, prompt, SamplingParams(max_tokens=4))
    kv = prefill_llm.engine.kv
    plan = exported.plan
    window = REF_WINDOW + 1
    assert plan.swa_start == 36 - (window - 1)  # the window before the page boundary at or below 37
    assert plan.full_bytes == 37 * kv.full_bytes_per_token
    assert plan.swa_bytes == (37 - plan.swa_start) * kv.swa_bytes_per_token
    assert exported.blob.numel() == plan.bytes < plan.full_attention_bytes


def test_prefix_cache_hits_on_the_prefill_side_transfer_the_same_kv(hf_checkpoint: Path) -> None:
    prefill_llm = LLM(hf_checkpoint, **OPTIONS)
    prompt = prompts(1, 42)[0]  # a checkpoint at 40, and a token past it to run
    params = SamplingParams(max_tokens=3)
    cold = prefill(prefill_llm, prompt, params)
    warm = prefill(prefill_llm, prompt, params)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 40
    # The same KV, up to the rounding of computing the last tokens in a smaller batch.
    torch.testing.assert_close(cold.blob.view(torch.float32), warm.blob.view(torch.float32), rtol=1e-4, atol=1e-5)
    assert_pools_full(prefill_llm)


def test_sampled_requests_go_on_with_the_prefill_sides_seed(hf_checkpoint: Path) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True)
    batch = prompts(2, 25, seed=3)
    single = LLM(hf_checkpoint, **OPTIONS)
    expected = [out.token_ids for out in single.generate(batch, params)]
    assert disaggregated(LLM(hf_checkpoint, **OPTIONS), LLM(hf_checkpoint, **OPTIONS), batch, params) == expected


def test_a_first_token_that_ends_the_request_finishes_it_on_arrival(hf_checkpoint: Path) -> None:
    prefill_llm, decode_llm = LLM(hf_checkpoint, **OPTIONS), LLM(hf_checkpoint, **OPTIONS)
    prompt = prompts(1, 20)[0]
    params = SamplingParams(max_tokens=1)
    rid = prefill_llm.add_request(prompt, params, export_kv=True)
    events = [e for _ in range(3) for e in prefill_llm.step()]
    assert [e.finish_reason for e in events] == ["length"]
    exported = prefill_llm.take_export(rid)
    assert exported is not None and exported.finish_reason == "length"
    reservation = decode_llm.reserve_kv(len(prompt), 1)
    decode_llm.fill_reservation(reservation, exported.blob)
    rid = decode_llm.add_prefilled(reservation, prompt, params, exported)
    assert [(e.request_id, e.token, e.finish_reason) for e in decode_llm.step()] == [(rid, exported.first_token,
                                                                                       "length")]
    assert not decode_llm.engine.has_unfinished()
    assert_pools_full(decode_llm)


def test_cancelled_and_refused_reservations_leave_the_pools_at_capacity(hf_checkpoint: Path) -> None:
    decode_llm = LLM(hf_checkpoint, **OPTIONS)
    held = [decode_llm.reserve_kv(40, 8) for _ in range(4)]
    assert all(r is not None for r in held)
    assert decode_llm.reserve_kv(40, 8) is None  # the running limit counts reservations
    with pytest.raises(ValueError):
        decode_llm.fill_reservation(held[0], torch.zeros(3, dtype=torch.uint8))  # not this transfer's size
    for reservation in held:
        assert decode_llm.cancel_reservation(reservation)
    assert not decode_llm.cancel_reservation(held[0])
    with pytest.raises(ValueError):
        decode_llm.reserve_kv(10**6, 8)
    assert_pools_full(decode_llm)


def test_a_reservation_holds_full_pages_and_the_live_window_only() -> None:
    allocator = KVAllocator(FullKVPool(64, 16), SWAKVPool(200, 1), window=128)
    view = allocator.new_view()
    allocator.reserve(view, 1000)
    assert len(view.full_pages) == 63
    assert view.swa_base == 992 - 127 and view.swa_end_pos == 1000
    assert allocator.reserve_needs(1000) == (63, 135)
    allocator.free(view)
    assert allocator.full.free_pages == 64 and allocator.swa.free_pages == 200


def test_planned_transfer_of_a_long_prompt_is_a_seventh_for_the_pro_shape() -> None:
    config = PRESETS["mimo-v2.5-pro"]()
    long = plan_for_config(config, 131072)
    assert 0.12 < long.ratio < 0.2
    assert plan_for_config(config, 131072, swa_mode="full").ratio == 1.0
    assert plan_for_config(config, 32768).ratio > long.ratio
    short = plan_transfer(10, 4, 8, 100, 50)
    assert short.swa_start == 1 and short.bytes == 10 * 100 + 9 * 50
