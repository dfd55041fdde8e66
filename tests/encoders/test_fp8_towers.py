"""Encoder towers stored FP8 beside an FP8 LLM: dequantized by their scales as
the LLM's matrices are, and nothing under a tower's prefix left unread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from api.models import write_random_multimodal
from encoders.multimodal_checkpoint import ENCODER_SHARD, load_encoders
from llm_core.model.fp8 import quantize_blockwise
from llm_core.loading.fp8_dequantize import write_dequantized_copy
from llm_core.model.presets import tiny
from llm_core.loading.weights import CheckpointError


def _rewrite_towers(model_dir: Path, edit) -> None:  # noqa: ANN001
    path = model_dir / ENCODER_SHARD
    with safe_open(str(path), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    edit(tensors)
    save_file(tensors, str(path))
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != ENCODER_SHARD}
    index["weight_map"].update(dict.fromkeys(tensors, ENCODER_SHARD))
    index_path.write_text(json.dumps(index))


def _quantize_tower_matrices(tensors: dict[str, torch.Tensor]) -> None:
    for name in [n for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2
                 and n.startswith(("visual.blocks.", "audio_tower.layers."))]:
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize_blockwise(tensors[name],
                                                                                                    (32, 32))


@pytest.fixture(scope="module")
def fp8_towers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8-towers")
    fp8 = write_random_multimodal(root / "fp8", tiny(), seed=1, fp8_block=(32, 32))
    _rewrite_towers(fp8, _quantize_tower_matrices)
    return fp8, write_dequantized_copy(fp8, root / "dequantized")


def test_fp8_towers_load_as_their_dequantized_weights(fp8_towers: tuple[Path, Path]) -> None:
    fp8, dequantized = fp8_towers
    ours, reference = load_encoders(fp8), load_encoders(dequantized)
    assert set(ours) == {"vision", "audio"}
    for kind in ours:
        theirs = reference[kind].state_dict()
        for name, tensor in ours[kind].state_dict().items():
            assert torch.equal(tensor, theirs[name]), f"{kind}: {name}"


def test_a_tower_tensor_nothing_reads_is_an_error(fp8_towers: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fp8_towers[0], bad)
    _rewrite_towers(bad, lambda t: t.update({"visual.blocks.0.attn.extra.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=r"under 'visual\.' .* first 'visual\.blocks\.0\.attn\.extra\.weight'"):
        load_encoders(bad)
