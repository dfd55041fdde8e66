from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from llm_core.config import ConfigError, ModelConfig
from llm_core.presets import PRESETS, get_preset, mimo_v2_5_pro, mimo_v2_flash, tiny


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
