from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from llm_core.model.config import ConfigError, ModelConfig
from llm_core.model.presets import PRESETS, get_preset, mimo_v2_5_pro, mimo_v2_flash, tiny


def test_transformers_config_json_parses_with_its_conventions(hf_checkpoint: Path) -> None:
    config = ModelConfig.from_json_file(hf_checkpoint / "config.json")
    raw = json.loads((hf_checkpoint / "config.json").read_text())
    assert config.layer_types == ("full", "sliding", "sliding", "full", "sliding")
    assert config.mlp_layer_types == ("dense", "sparse", "sparse", "sparse", "sparse")
    # transformers' sliding_window counts the query; W counts previous tokens only.
    assert config.sliding_attention.sliding_window == raw["sliding_window"]
    assert config.window_size == raw["sliding_window"] - 1
    # SWA layers get twice the KV heads and sinks; full layers neither.
    assert config.sliding_attention.num_kv_heads == 2 * config.full_attention.num_kv_heads
    assert config.sliding_attention.has_sinks and not config.full_attention.has_sinks
    assert config.full_attention.rotary_dim == int(32 * 0.334)
    assert config.sliding_attention.rotary_dim == 16
    assert config.routed_scaling_factor == 1.5
    assert config.attention_value_scale == pytest.approx(0.707)


def test_config_is_frozen() -> None:
    config = tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 3  # type: ignore[misc]


def test_to_hf_dict_round_trips_every_preset() -> None:
    for name in PRESETS:
        config = get_preset(name)
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


def test_mimo_v2_flash_preset_shape() -> None:
    config = mimo_v2_flash()
    assert config.num_hidden_layers == 48
    assert config.full_layer_ids == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert len(config.sliding_layer_ids) == 39
    assert config.window_size == 128
    assert config.sliding_attention.num_kv_heads == 2 * config.full_attention.num_kv_heads
    assert config.full_attention.rotary_dim == 64
    assert 300e9 < config.num_parameters() < 320e9  # the published 309B


def test_mimo_v2_5_pro_preset_shape() -> None:
    config = mimo_v2_5_pro()
    assert config.num_hidden_layers == 70
    assert config.full_layer_ids == (0, 7, 15, 23, 31, 39, 47, 55, 62, 69)
    assert config.hidden_size == 6144 and config.full_attention.num_heads == 128
    assert config.full_attention.num_kv_heads == config.sliding_attention.num_kv_heads == 8
    assert (config.n_routed_experts, config.num_experts_per_tok, config.window_size) == (384, 8, 128)


def test_hub_defaults_differ_from_transformers_defaults() -> None:
    base = tiny().to_hf_dict()
    hub = {k: v for k, v in base.items() if k not in ("attention_value_scale", "add_swa_attention_sink_bias",
                                                       "add_full_attention_sink_bias", "swa_num_key_value_heads")}
    # transformers spelling: value scale defaults to 0.707, sinks on SWA layers, 2x KV heads.
    t = ModelConfig.from_hf_dict(hub)
    assert t.attention_value_scale == pytest.approx(0.707) and t.sliding_attention.has_sinks
    assert t.sliding_attention.num_kv_heads == 2 * t.full_attention.num_kv_heads
    # hub spelling: no scale unless given; sinks only when flagged.
    h = ModelConfig.from_hf_dict({**hub, "model_type": "mimo_v2", "attention_value_scale": None,
                                  "add_swa_attention_sink_bias": False})
    assert h.attention_value_scale == 1.0 and not h.sliding_attention.has_sinks


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"model_type": None}, "unsupported model_type None"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"layer_types": ["full_attention", "chunked_attention"] * 3}, "chunked_attention"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types"),
        ({"num_key_value_heads": 3}, "not divisible"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "yarn"),
        ({"n_group": 3}, "n_group"),
    ],
)
def test_bad_configs_raise_clear_errors(patch: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**tiny().to_hf_dict(), **patch})


def test_unreadable_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json_file(tmp_path / "config.json")


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        get_preset("huge")


def _with_rotary(head_dim: int, factor: float, **fields: object) -> dict:
    """tiny() as a config.json, with this q/k head dim and rotary factor on both layer types."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": factor}
    return {**tiny().to_hf_dict(), "head_dim": head_dim, "swa_head_dim": head_dim,
            "rope_parameters": {"full_attention": rope, "sliding_attention": rope}, **fields}


def test_odd_rotary_dims_load_as_transformers_runs_them() -> None:
    config = ModelConfig.from_hf_dict(_with_rotary(16, 0.334))
    assert (config.full_attention.rope_dim, config.full_attention.rotary_dim) == (5, 6)
    config = ModelConfig.from_hf_dict(_with_rotary(2, 0.334))
    assert config.sliding_attention.rotary_dim == 0  # int(0.668) = 0: no rotary at all


@pytest.mark.parametrize(
    ("head_dim", "factor", "message"),
    [
        (3, 1.0, "rotates 4 channels"),  # transformers: a shape mismatch in its forward
        (1, 1.0, "rotates 2 channels"),  # transformers: broadcasts q and k to two channels
        (16, 1.5, "rotates 24 channels"),
        (16, -0.5, "negative"),  # transformers: torch.arange(0, -8, 2) fails
    ],
)
def test_rotary_that_transformers_cannot_run_is_refused(head_dim: int, factor: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(_with_rotary(head_dim, factor))


def test_only_attention_that_some_layer_runs_must_be_valid() -> None:
    # transformers builds no SWA module in an all-full model: its doubled KV
    # heads (8) need not divide the 4 heads.
    data = {**tiny().to_hf_dict(), "layer_types": ["full_attention"] * 6, "num_key_value_heads": 4,
            "num_nextn_predict_layers": 0}
    del data["swa_num_key_value_heads"]
    config = ModelConfig.from_hf_dict(data)
    assert config.used_layer_types == ("full",) and config.sliding_attention.num_kv_heads == 8
    mixed = ["full_attention"] + ["sliding_attention"] * 5
    with pytest.raises(ConfigError, match="not divisible by 8"):
        ModelConfig.from_hf_dict({**data, "layer_types": mixed})
    with pytest.raises(ConfigError, match="not divisible by 8"):  # MTP layers attend like SWA layers
        ModelConfig.from_hf_dict({**data, "num_nextn_predict_layers": 1})


def test_rope_parameters_may_leave_out_only_a_layer_type_no_layer_runs() -> None:
    full_only = {"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}}
    data = {**tiny().to_hf_dict(), "layer_types": ["full_attention"] * 6, "num_nextn_predict_layers": 0,
            "rope_parameters": full_only}
    assert ModelConfig.from_hf_dict(data).full_attention.rope_theta == 5e6
    with pytest.raises(ConfigError, match="no entry for the sliding_attention layers"):
        ModelConfig.from_hf_dict({**data, "num_nextn_predict_layers": 1})
    with pytest.raises(ConfigError, match="no rope_theta"):
        ModelConfig.from_hf_dict({**data, "rope_parameters": {"full_attention": {"rope_type": "default"}}})


def test_a_zero_value_scale_is_a_scale() -> None:
    assert ModelConfig.from_hf_dict({**tiny().to_hf_dict(), "attention_value_scale": 0.0}).attention_value_scale == 0.0
