"""`LLM`, the offline entry point: what it refuses before running anything
(with a reason), that one request's sampling never changes another's tokens,
and that streamed tokens are the returned ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_core import LLM, SamplingParams
from llm_core.device import compute_dtype


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    engine = LLM(tiny_checkpoint, kv_budget_bytes=8 << 20, speculative_tokens=0)
    yield engine
    engine.close()


def test_unknown_names_are_refused_with_the_choices(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\]"):
        LLM(tiny_checkpoint, dtype="float64")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(tiny_checkpoint, quantization="int4")  # type: ignore[arg-type]
    assert compute_dtype("bfloat16").is_floating_point


def test_a_batch_is_validated_whole_before_anything_runs(llm: LLM) -> None:
    context = llm.config.max_position_embeddings
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2)])
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        llm.generate([[5, 6], [7] * context], SamplingParams(max_tokens=4))
    stats = llm.stats()
    assert stats["running_requests"] == 0 and stats["waiting_requests"] == 0  # nothing was admitted


def test_streamed_tokens_are_the_returned_ones_and_sampling_stays_per_request(llm: LLM) -> None:
    prompts = [[11, 12, 13, 14], [21, 22, 23]]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = llm.generate(prompts[:1], greedy)[0].token_ids
    streamed: dict[int, list[int]] = {0: [], 1: []}
    outputs = llm.generate(prompts, [greedy, SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)],
                           on_token=lambda i, token, _: streamed[i].append(token))
    assert [o.token_ids for o in outputs] == [streamed[0], streamed[1]]
    assert outputs[0].token_ids == alone  # a sampled neighbour does not move a greedy request
    assert [o.finish_reason for o in outputs] == ["length", "length"]
