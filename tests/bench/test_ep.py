from __future__ import annotations

from pathlib import Path

import torch

from bench.ep import ep_bench


def test_ep_bench_reports_identity_bytes_and_the_plan(tiny_checkpoint: Path) -> None:
    threads = torch.get_num_threads()
    result = ep_bench(tiny_checkpoint, sizes=(1, 2), num_prompts=3, max_tokens=4, chunk=16)
    assert torch.get_num_threads() == threads  # the ranks ran on one thread each; this process gets its own back
    assert result["identical"] is True
    assert result["max_logit_diff"] <= result["logit_tolerance"]
    one, two = result["ranks"]["1"], result["ranks"]["2"]
    assert one["all_to_all_bytes_per_step"] == 0 and one["plan_all_to_all_bytes_per_token"] == 0
    assert two["tokens_identical"] and two["tokens_per_s"] > 0 and two["steps"] > 0
    assert two["all_to_all_bytes_per_step"] > 0
    # tiny's group-limited routing keeps about half of a token's experts on the other rank, as the plan assumes.
    assert 0.5 < two["all_to_all_bytes_per_token"] / two["plan_all_to_all_bytes_per_token"] < 1.5
    assert two["routed_expert_bytes_per_rank"] * 2 == one["routed_expert_bytes_per_rank"]
