"""The determinism contract's root: our model equals transformers' MiMoV2Flash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_core import LLM, SamplingParams
from llm_core.kv.kv_cache import ContiguousAttention, RequestKVCache, Segment
from tests.conftest import REF_MTP_LAYERS, REF_WINDOW


def _prompt(length: int, seed: int, vocab: int = 320) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def _our_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor(prompt)
    backend = ContiguousAttention([Segment(RequestKVCache(), 0, len(prompt))], "cpu")
    with torch.inference_mode():
        hidden = llm.model(ids, torch.arange(len(prompt)), backend)
        return llm.model.compute_logits(hidden)


def _hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def llm(hf_checkpoint: Path) -> LLM:
    return LLM(hf_checkpoint, device="cpu", dtype="float32")


@pytest.mark.parametrize("length", [3, REF_WINDOW, 5 * REF_WINDOW + 3, 700])
def test_full_sequence_logits_match_transformers(llm: LLM, hf_model, length: int) -> None:
    prompt = _prompt(length, seed=length)
    ours = _our_logits(llm, prompt)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    assert ours.shape == ref.shape
    assert torch.max(torch.abs(ours - ref)).item() < 1e-4


def test_logits_are_peaky_enough_to_make_greedy_comparisons_meaningful(llm: LLM) -> None:
    logits = _our_logits(llm, _prompt(64, seed=3))
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 1e-2
    # Not a degenerate model: it predicts many different tokens.
    assert len(set(logits.argmax(-1).tolist())) > 10


def test_greedy_generation_matches_transformers_in_one_batched_call(llm: LLM, hf_model) -> None:
    lengths = [1, 4, REF_WINDOW, REF_WINDOW + 1, 3 * REF_WINDOW, 12 * REF_WINDOW + 5]
    prompts = [_prompt(n, seed=100 + n) for n in lengths]
    max_new = 4 * REF_WINDOW  # decoding runs far past the window too
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_new))
    assert [o.finish_reason for o in outputs] == ["length"] * len(prompts)
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == _hf_greedy(hf_model, prompt, max_new)


def test_small_batched_token_budget_chunks_prefill_without_changing_tokens(hf_checkpoint: Path, llm: LLM) -> None:
    prompts = [_prompt(n, seed=200 + n) for n in (5, 37, 90)]
    params = SamplingParams(max_tokens=12)
    chunked = LLM(hf_checkpoint, max_num_batched_tokens=7)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in chunked.generate(prompts, params)] == expected


def _to_hub_spelling(model_dir: Path) -> None:
    """Rewrite config.json with the original hub field names."""
    cfg = json.loads((model_dir / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    hub = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2",
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
        "v_head_dim": cfg["v_head_dim"],
        "swa_num_attention_heads": cfg["num_attention_heads"],
        "swa_num_key_value_heads": 2 * cfg["num_key_value_heads"],
        "swa_head_dim": cfg["head_dim"],
        "swa_v_head_dim": cfg["v_head_dim"],
        "hybrid_layer_pattern": [int(t == "sliding_attention") for t in cfg["layer_types"]],
        "moe_layer_freq": [int(t == "sparse") for t in cfg["mlp_layer_types"]],
        "sliding_window_size": cfg["sliding_window"] - 1,
        "add_full_attention_sink_bias": False,
        "add_swa_attention_sink_bias": True,
        "rope_theta": rope["full_attention"]["rope_theta"],
        "swa_rope_theta": rope["sliding_attention"]["rope_theta"],
        "partial_rotary_factor": rope["full_attention"]["partial_rotary_factor"],
        "layernorm_epsilon": cfg["rms_norm_eps"],
        "attention_value_scale": cfg["attention_value_scale"],
        "n_routed_experts": cfg["n_routed_experts"],
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "n_group": cfg["n_group"],
        "topk_group": cfg["topk_group"],
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": cfg["routed_scaling_factor"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "num_nextn_predict_layers": REF_MTP_LAYERS,
        "hidden_act": "silu",
    }
    (model_dir / "config.json").write_text(json.dumps(hub))


def test_hub_field_names_load_to_the_same_outputs(checkpoint_copy: Path, llm: LLM) -> None:
    # The hub spelling has one partial_rotary_factor; give both layer types the same one.
    cfg = json.loads((checkpoint_copy / "config.json").read_text())
    if cfg["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] != cfg["rope_parameters"][
        "full_attention"
    ]["partial_rotary_factor"]:
        cfg["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] = cfg["rope_parameters"][
            "full_attention"
        ]["partial_rotary_factor"]
        reference = checkpoint_copy.parent / "same_rope"
        import shutil

        shutil.copytree(checkpoint_copy, reference)
        (reference / "config.json").write_text(json.dumps(cfg))
        llm = LLM(reference)
        (checkpoint_copy / "config.json").write_text(json.dumps(cfg))
    _to_hub_spelling(checkpoint_copy)
    hub_llm = LLM(checkpoint_copy)
    assert hub_llm.config == llm.config
    prompt = _prompt(3 * REF_WINDOW, seed=7)
    assert torch.equal(_our_logits(hub_llm, prompt), _our_logits(llm, prompt))
    params = SamplingParams(max_tokens=10)
    assert hub_llm.generate([prompt], params)[0].token_ids == llm.generate([prompt], params)[0].token_ids


def test_mtp_layers_load_from_the_checkpoint_and_run(llm: LLM, hf_checkpoint: Path) -> None:
    from safetensors import safe_open

    assert llm.config.num_mtp_layers == REF_MTP_LAYERS
    mtp = llm.model.model.mtp.layers[0]
    with safe_open(str(hf_checkpoint / "model-mtp.safetensors"), "pt") as f:
        assert torch.equal(mtp.eh_proj.weight, f.get_tensor("model.mtp.layers.0.eh_proj.weight"))
        assert torch.equal(mtp.self_attn.sinks, f.get_tensor("model.mtp.layers.0.self_attn.attention_sink_bias"))
    prompt = _prompt(20, seed=9)
    n = len(prompt) - 1
    cache = RequestKVCache()
    with torch.inference_mode():
        hidden = llm.model(torch.tensor(prompt), torch.arange(len(prompt)),
                           ContiguousAttention([Segment(RequestKVCache(), 0, len(prompt))], "cpu"))
        # MTP at position t sees main hidden state h_t and the embedding of token t+1.
        out = llm.model.mtp_forward(0, torch.tensor(prompt[1:]), hidden[:-1], torch.arange(n),
                                    ContiguousAttention([Segment(cache, 0, n)], "cpu"))
        logits = llm.model.compute_logits(out)
    assert logits.shape == (n, llm.config.vocab_size)
    assert torch.isfinite(logits).all()
    # Its SWA KV lives under its own layer index and respects the window.
    assert cache.num_tokens(llm.config.num_hidden_layers) == REF_WINDOW
