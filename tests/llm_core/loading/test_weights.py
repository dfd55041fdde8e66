from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_core import LLM, CheckpointError, ConfigError
from llm_core.model.presets import tiny
from llm_core.loading.weights import CheckpointReader, load_model, save_model
from llm_core.loading.checkpoint import random_model


def _rewrite_main_shard(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != "model.safetensors"}
    index["weight_map"].update(dict.fromkeys(tensors, "model.safetensors"))
    index_path.write_text(json.dumps(index))


def test_missing_tensor_is_named(checkpoint_copy: Path) -> None:
    _rewrite_main_shard(checkpoint_copy, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        LLM(checkpoint_copy)


def test_missing_mtp_tensor_is_named(checkpoint_copy: Path) -> None:
    path = checkpoint_copy / "model-mtp.safetensors"
    tensors = load_file(str(path))
    del tensors["model.mtp.layers.0.hnorm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"model\.mtp\.layers\.0\.hnorm\.weight"):
        LLM(checkpoint_copy)


def test_wrong_shape_names_tensor_and_both_shapes(checkpoint_copy: Path) -> None:
    def edit(t: dict) -> None:
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)

    _rewrite_main_shard(checkpoint_copy, edit)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight'.*\[32, 64\].*\[64, 64\]"):
        LLM(checkpoint_copy)


def test_unknown_model_type(checkpoint_copy: Path) -> None:
    cfg = json.loads((checkpoint_copy / "config.json").read_text())
    (checkpoint_copy / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_moe"}))
    with pytest.raises(ConfigError, match="unsupported model_type 'qwen3_moe'"):
        LLM(checkpoint_copy)


def test_no_weights_and_dangling_index(tmp_path: Path, checkpoint_copy: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny().to_hf_dict()))
    with pytest.raises(CheckpointError, match="no .safetensors weights"):
        LLM(tmp_path)
    (checkpoint_copy / "model-mtp.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing file"):
        LLM(checkpoint_copy)


def test_sharded_save_and_lazy_load_round_trip(tmp_path: Path) -> None:
    config = tiny()
    model = random_model(config, seed=3)
    save_model(model, tmp_path, max_shard_bytes=1 << 20)
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = load_model(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_bfloat16_load_keeps_router_in_float32(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_reader_counts_mtp_layers(hf_checkpoint: Path) -> None:
    with CheckpointReader(hf_checkpoint) as reader:
        assert reader.mtp_layer_count() == 1


def test_corrupt_safetensors_file(checkpoint_copy: Path) -> None:
    (checkpoint_copy / "model-mtp.safetensors").write_bytes(b"\x00garbage, not safetensors")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        LLM(checkpoint_copy)


def test_loaded_weights_are_aligned(hf_checkpoint: Path) -> None:
    from llm_core.loading.weights import load_model

    model = load_model(hf_checkpoint, "cpu", torch.float32)
    assert {p.data_ptr() % 64 for p in model.parameters()} == {0}
