"""``swallow bench structured`` on a small batch: the figures it prints and the
checks it makes on the constrained outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.structured import SCHEMA, structured_bench
from llm_core import LLM, SamplingParams
from llm_core.sample.grammar import GrammarSpec

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def test_bench_prints_both_rates_and_their_ratio() -> None:
    result = structured_bench(DEMO, batch=2, max_tokens=24, repeats=1)
    for figures in (result, result["without_drafts"]):
        constrained, unconstrained = figures["constrained_tok_s"], figures["unconstrained_tok_s"]
        assert constrained > 0 and unconstrained > 0
        # The ratio is of the rates before they were rounded to 0.1 tok/s (and it to 0.001).
        ratio = constrained / unconstrained
        rounding = ratio * (0.05 / constrained + 0.05 / unconstrained) + 5e-4
        assert figures["ratio"] == pytest.approx(ratio, abs=rounding)
    assert result["speculative_tokens"] > 0 and result["without_drafts"]["speculative_tokens"] == 0
    json.dumps(result)


def test_the_bench_schema_never_completes_within_its_budget() -> None:
    """Both runs must generate max_tokens tokens: the schema outlasts them."""
    llm = LLM(DEMO, speculative_tokens=0)
    assert llm.tokenizer is not None
    prompt = llm.tokenizer.encode("<|im_start|>user\nDescribe it.<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(max_tokens=96, temperature=0.8, seed=3,
                            grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 96
