"""The EP capacity planner: parameter split, weights and KV per GPU for each EP
size, all-to-all bytes, and the smallest EP size for a target."""

from __future__ import annotations

import json

import pytest

from llm_core.plan import Hardware, all_to_all_bytes_per_token, ep_sizes, parameter_counts, plan
from llm_core.model.presets import get_preset, tiny


def test_parameters_split_into_routed_experts_and_the_rest() -> None:
    config = tiny()
    counts = parameter_counts(config)
    assert counts.total == config.num_parameters()
    sparse = sum(t == "sparse" for t in config.mlp_layer_types)
    # gate_up (2 x inter x hidden) and down (hidden x inter) per expert per MoE layer.
    assert counts.routed_experts == sparse * config.n_routed_experts * 3 * config.moe_intermediate_size \
        * config.hidden_size
    pro = parameter_counts(get_preset("mimo-v2.5-pro"))
    assert pro.routed_experts > 40 * pro.replicated  # the experts are nearly all of a large MoE


def test_ep_sizes_and_all_to_all_bytes() -> None:
    assert ep_sizes(16, 384) == [1, 2, 4, 8, 16]
    assert ep_sizes(12, 8) == [1, 2, 4]
    config = tiny()
    assert all_to_all_bytes_per_token(config, 1, 2) == 0  # every expert is local
    sparse = sum(t == "sparse" for t in config.mlp_layer_types)
    # EP 2: half of a token's experts are remote; hidden states go there and back.
    expected = 2 * sparse * config.num_experts_per_tok * 0.5 * config.hidden_size * 2
    assert all_to_all_bytes_per_token(config, 2, 2) == expected
    assert all_to_all_bytes_per_token(config, 8, 2) > all_to_all_bytes_per_token(config, 2, 2)


def test_plan_rows_and_the_smallest_ep_size() -> None:
    config = tiny()
    hardware = Hardware(gpus=8, gpu_mem_gib=0.05, reserve_gib=0.0, weights="bf16")
    result = plan(config, hardware, context=4096)
    rows = result["ep"]
    assert [r["ep_size"] for r in rows] == ep_sizes(8, config.n_routed_experts)
    weights = [r["weights_gib_per_gpu"] for r in rows]
    assert weights == sorted(weights, reverse=True)  # experts spread over more GPUs
    for row in rows:
        assert row["fits"] and row["swa_requests"] >= row["full_attention_requests"] > 0
        assert row["swa_requests"] == 8 * row["swa_requests_per_gpu"]
    # The default target is what full-attention KV reaches at the largest EP size;
    # SWA-aware pools reach it with no more EP.
    assert result["target_concurrency"] == rows[-1]["full_attention_requests"]
    assert result["smallest_ep_swa"] <= result["smallest_ep_full_attention"]
    # A target only SWA-aware pools reach: full attention fits it at no EP size.
    target = rows[0]["swa_requests"]
    assert target > rows[-1]["full_attention_requests"]
    swa_only = plan(config, hardware, context=4096, target_concurrency=target)
    assert swa_only["smallest_ep_swa"] == 1 and swa_only["smallest_ep_full_attention"] is None
    unreachable = plan(config, hardware, context=4096, target_concurrency=10**9)
    assert unreachable["smallest_ep_swa"] is None and unreachable["smallest_ep_full_attention"] is None


def test_weights_that_do_not_fit_leave_no_kv() -> None:
    result = plan(get_preset("mimo-v2.5-pro"), Hardware(gpus=16, gpu_mem_gib=141), context=131072)
    by_ep = {r["ep_size"]: r for r in result["ep"]}
    assert not by_ep[1]["fits"] and by_ep[1]["swa_requests"] == 0
    assert by_ep[16]["fits"] and by_ep[16]["swa_requests"] > 4 * by_ep[16]["full_attention_requests"]
    assert by_ep[16]["swa_requests"] > 0


def test_weights_are_counted_as_held() -> None:
    from llm_core.plan import parameter_counts, weight_bytes

    config = get_preset("mimo-v2-flash")
    params = parameter_counts(config).total
    fp8, bf16 = weight_bytes(config, "fp8"), weight_bytes(config, "bf16")
    # FP8 matrices, their scales, BF16 o_proj / embeddings / norms: a little over a byte per parameter.
    assert params < fp8.total < 1.1 * params
    assert 1.9 * fp8.total < bf16.total < 2.1 * params
    assert fp8.routed_experts > 10 * fp8.replicated


def test_hardware_is_checked() -> None:
    with pytest.raises(ValueError):
        Hardware(gpus=0, gpu_mem_gib=80)


def test_plan_command_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    from swallow.cli import main

    assert main(["plan", "--preset", "tiny", "--gpus", "4", "--gpu-mem-gib", "0.05", "--reserve-gib", "0",
                 "--context", "2048", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["preset"] == "tiny" and {r["ep_size"] for r in result["ep"]} == {1, 2, 4}
    assert main(["plan", "--preset", "tiny", "--gpus", "4", "--gpu-mem-gib", "0.01", "--reserve-gib", "0",
                 "--context", "2048"]) == 0
    assert "smallest EP size" in capsys.readouterr().out
