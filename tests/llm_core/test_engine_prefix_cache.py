"""Determinism contract with the prefix cache on: hits are as good as recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_core import LLM, SamplingParams
from tests.conftest import REF_WINDOW


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in memo:
            out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key]

    return run


def _cached(llm: LLM) -> int:
    return llm.stats()["prefix_cache"]["cached_prompt_tokens"]


def test_multi_turn_conversation_hits_and_matches_transformers(hf_checkpoint: Path, hf_greedy) -> None:
    on = LLM(hf_checkpoint, chunked_prefill_size=16, page_size=4)
    off = LLM(hf_checkpoint, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12)
    conversation = _ids(1, 37)
    for turn in range(4):
        before = _cached(on)
        got = on.generate([conversation], params)[0].token_ids
        assert got == off.generate([conversation], params)[0].token_ids == hf_greedy(conversation, 12)
        if turn:
            # Everything the previous turn computed (page-aligned) is served from the cache.
            assert _cached(on) - before >= len(conversation) - 12 - 4 - 5
        conversation = conversation + got + _ids(10 + turn, 5)  # previous prompt + output + new text
    stats = on.stats()["prefix_cache"]
    assert stats["hit_rate"] > 0.5


def test_shared_system_prompt_across_a_batch(hf_checkpoint: Path, hf_greedy) -> None:
    on = LLM(hf_checkpoint, chunked_prefill_size=16, page_size=4, checkpoint_interval=16)
    params = SamplingParams(max_tokens=8)
    system = _ids(2, 50)
    first = [system + _ids(20 + i, 3 + i) for i in range(3)]
    second = [system + _ids(30 + i, 6) for i in range(4)]
    for batch in (first, second):
        outs = on.generate(batch, params)
        assert [o.token_ids for o in outs] == [hf_greedy(p, 8) for p in batch]
    # The second batch starts from the system prompt's checkpoint at 48.
    assert _cached(on) >= 4 * 48


def test_window_longer_prompts_hit_at_checkpoints_only(hf_checkpoint: Path, hf_greedy) -> None:
    on = LLM(hf_checkpoint, page_size=4)
    long_prompt = _ids(3, 20 * REF_WINDOW)
    on.generate([long_prompt], SamplingParams(max_tokens=4))
    # Diverging in the middle: full KV is cached there, but no SWA window: no hit.
    before = _cached(on)
    diverged = long_prompt[:100] + _ids(4, 9)
    assert on.generate([diverged], SamplingParams(max_tokens=6))[0].token_ids == hf_greedy(diverged, 6)
    assert _cached(on) == before


def test_aborted_request_leaves_what_it_computed(hf_checkpoint: Path, hf_greedy) -> None:
    on = LLM(hf_checkpoint, chunked_prefill_size=16, max_num_batched_tokens=16, page_size=4)
    prompt = _ids(5, 90)
    rid = on.add_request(prompt, SamplingParams(max_tokens=5))
    for _ in range(3):
        on.step()  # 48 tokens prefilled
    on.abort(rid)
    before = _cached(on)
    assert on.generate([prompt], SamplingParams(max_tokens=5))[0].token_ids == hf_greedy(prompt, 5)
    assert _cached(on) - before == 48
    on.flush_cache()
    stats = on.stats()
    assert stats["full_pool"]["free_tokens"] == stats["full_pool"]["capacity_tokens"]
    assert stats["swa_pool"]["free_tokens"] == stats["swa_pool"]["capacity_tokens"]


def test_a_waiting_request_does_not_pin_cached_pages_the_running_ones_need(tiny_checkpoint: Path) -> None:
    # A pool this small only works if the waiting head, having matched the shared
    # prefix, lets go of it while it cannot be admitted: before, it pinned those
    # pages and the running requests ran out of room ("needs more KV memory").
    llm = LLM(tiny_checkpoint, kv_budget_bytes=512 << 10, page_size=4, chunked_prefill_size=8,
              max_running_requests=4, checkpoint_interval=8)
    shared = list(range(20, 52))
    prompts = [shared + list(range(60 + i, 64 + 3 * i)) for i in range(6)] + [list(range(5, 40))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM(tiny_checkpoint, enable_prefix_caching=False).generate(prompts, params)]
    for _ in range(2):
        outputs = llm.generate(prompts, params)
        assert [o.finish_reason for o in outputs] == ["length"] * len(prompts)
        assert [o.token_ids for o in outputs] == expected
    llm.flush_cache()
    stats = llm.stats()
    assert stats["full_pool"]["free_tokens"] == stats["full_pool"]["capacity_tokens"]
