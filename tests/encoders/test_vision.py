"""encoders.vision against transformers' Qwen2_5_VisionTransformerPretrainedModel (an
oracle only), on a tiny random tower saved and reloaded through a checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from encoders.vision import VisionEncoder, VisionEncoderConfig, VisionInput, load_vision_encoder
from llm_core.model.config import ConfigError
from llm_core.loading.weights import CheckpointError
from media.vision_geometry import VisionPreprocessConfig
from media.vision_preprocess import preprocess_images

# Tiny tower: window_size 56 is 2x2 merge units, so the grids below have full and partial
# windows, and blocks 1 and 3 attend to whole frames.
WINDOW = 56
PATCH_DIM = 3 * 2 * 14 * 14
# Images (t=1) of several sizes, merged grids that are and are not multiples of the
# window, and a 4-frame video clip.
GRIDS = [(1, 4, 4), (1, 6, 10), (1, 14, 8), (1, 2, 2), (4, 6, 8)]
# float32 end to end; outputs are O(1) (see _randomize). Measured max |diff| vs
# transformers ~8e-6 (transformers' own sdpa vs eager: 2e-6; vs a float64 run: 8e-6).
REF_ATOL = 1e-4
BATCH_ATOL = 1e-5


def _hf_config():  # -> transformers.Qwen2_5_VLVisionConfig
    from transformers import Qwen2_5_VLVisionConfig

    cfg = Qwen2_5_VLVisionConfig(
        depth=4,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=96,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=WINDOW,
        fullatt_block_indexes=[1, 3],
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def _randomize(model: torch.nn.Module) -> None:
    """Weights that keep activations O(1) and make attention far from uniform (with the
    default 0.02 init every query sees an almost flat softmax, which would hide window,
    frame and rope mistakes)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or "ln_q" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                fan_in = math.prod(p.shape[1:])
                # Sharper attention. Windowed vs all-full attention then differ by ~2.5
                # at the output; much sharper makes float32 rounding itself chaotic.
                gain = 1.5 if "attn.qkv" in name else 1.0
                p.copy_(noise * gain / math.sqrt(fan_in))


@pytest.fixture(scope="session")
def hf_tower():  # -> transformers Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    model = Qwen2_5_VisionTransformerPretrainedModel(_hf_config()).eval()
    _randomize(model)
    return model


@pytest.fixture(scope="session")
def tower_checkpoint(hf_tower, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tower alone, as transformers saves it (unprefixed names, bare vision config)."""
    out = tmp_path_factory.mktemp("hf_vision")
    hf_tower.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def encoder(tower_checkpoint: Path) -> VisionEncoder:
    return load_vision_encoder(tower_checkpoint)


def _write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def _vlm_checkpoint(hf_tower, out: Path, prefix: str, drop: str | None = None) -> Path:
    """A whole-VLM-style checkpoint: the tower under ``prefix`` next to a stray LLM tensor,
    with a Qwen2.5-VL top-level config.json."""
    tensors = {prefix + k: v for k, v in hf_tower.state_dict().items() if k != drop}
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(8, 4)
    config = {
        "model_type": "qwen2_5_vl",
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_size": 96,
        "vision_config": hf_tower.config.to_dict(),
    }
    return _write_checkpoint(out, tensors, config)


def _pixels(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    t, h, w = grid
    return torch.randn(t * h * w, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


def _reference(hf_tower, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    with torch.no_grad():
        return hf_tower(pixels, torch.tensor(grids)).pooler_output


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------------------------------
# Numerics against transformers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_single_item_matches_transformers(hf_tower, encoder: VisionEncoder, grid) -> None:
    pixels = _pixels(grid, seed=sum(grid))
    expected = _reference(hf_tower, pixels, [grid])
    with torch.no_grad():
        got = encoder(pixels, [grid])
    assert got.shape == (grid[0] * grid[1] * grid[2] // 4, 96)
    diff = _max_diff(got, expected)
    print(f"grid {grid}: max |diff| {diff:.2e}, mean |out| {expected.abs().mean():.2f}")
    assert diff <= REF_ATOL


def test_packed_items_match_transformers(hf_tower, encoder: VisionEncoder) -> None:
    pixels = torch.cat([_pixels(g, seed=i) for i, g in enumerate(GRIDS)])
    expected = _reference(hf_tower, pixels, GRIDS)
    with torch.no_grad():
        got = encoder(pixels, torch.tensor(GRIDS))
    diff = _max_diff(got, expected)
    print(f"packed {len(GRIDS)} items: max |diff| {diff:.2e}")
    assert diff <= REF_ATOL


def test_encode_batch_equals_items_alone(encoder: VisionEncoder) -> None:
    items = [VisionInput(_pixels(g, seed=10 + i), g) for i, g in enumerate(GRIDS)]
    batched = encoder.encode_batch(items)
    assert [tuple(o.shape) for o in batched] == [(encoder.num_tokens(it), 96) for it in items]
    diff = max(_max_diff(out, encoder.encode_batch([it])[0]) for it, out in zip(items, batched))
    print(f"encode_batch vs one by one: max |diff| {diff:.2e}")
    assert diff <= BATCH_ATOL
    assert not batched[0].requires_grad and batched[0].device == torch.device("cpu")


def test_preprocessed_images_match_transformers(hf_tower, encoder: VisionEncoder) -> None:
    gen = torch.Generator().manual_seed(5)
    images = [torch.randint(0, 256, (3, 60, 90), dtype=torch.uint8, generator=gen),
              torch.randint(0, 256, (3, 100, 50), dtype=torch.uint8, generator=gen)]
    batch = preprocess_images(images, VisionPreprocessConfig())
    grids = [tuple(g) for g in batch.grid_thw.tolist()]
    assert len(set(grids)) == 2
    items = [VisionInput(pv, g) for pv, g in zip(batch.split(), grids)]
    for item in items:
        encoder.check(item)
    got = torch.cat(encoder.encode_batch(items))
    diff = _max_diff(got, _reference(hf_tower, batch.pixel_values, grids))
    print(f"preprocessed images {grids}: max |diff| {diff:.2e}")
    assert diff <= REF_ATOL


def test_empty_inputs(encoder: VisionEncoder) -> None:
    assert encoder.encode_batch([]) == []
    assert encoder(torch.empty(0, PATCH_DIM), []).shape == (0, 96)


def test_bfloat16_load_keeps_float32_rope(tower_checkpoint: Path, encoder: VisionEncoder) -> None:
    half = load_vision_encoder(tower_checkpoint, dtype=torch.bfloat16)
    assert half.rotary_pos_emb.inv_freq.dtype == torch.float32
    assert torch.equal(half.rotary_pos_emb.inv_freq, encoder.rotary_pos_emb.inv_freq)
    item = VisionInput(_pixels((1, 6, 10), seed=3), (1, 6, 10))
    (got,) = half.encode_batch([item])
    (ref,) = encoder.encode_batch([item])
    assert got.dtype == torch.bfloat16
    # bf16 weights and activations: a loose sanity bound, relative to the output scale.
    mean_diff = float((got.float() - ref).abs().mean())
    print(f"bfloat16 vs float32: mean |diff| {mean_diff:.3f}, mean |out| {ref.abs().mean():.3f}")
    assert mean_diff < 0.05 * float(ref.abs().mean())


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


def test_parameters_and_buffers_match_transformers(hf_tower, encoder: VisionEncoder) -> None:
    assert list(encoder.state_dict()) == list(hf_tower.state_dict())
    assert torch.equal(encoder.rotary_pos_emb.inv_freq, hf_tower.rotary_pos_emb.inv_freq)
    assert not encoder.training


@pytest.mark.parametrize("prefix", ["visual.", "model.visual."])
def test_load_prefixed_checkpoint(hf_tower, encoder: VisionEncoder, tmp_path: Path, prefix: str) -> None:
    loaded = load_vision_encoder(_vlm_checkpoint(hf_tower, tmp_path / "ckpt", prefix))
    assert loaded.config == encoder.config
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.identity == encoder.identity


def test_missing_tensor_is_named(hf_tower, tmp_path: Path) -> None:
    missing = "blocks.2.mlp.up_proj.bias"
    ckpt = _vlm_checkpoint(hf_tower, tmp_path / "ckpt", "visual.", drop=missing)
    with pytest.raises(CheckpointError, match=f"visual.{missing}"):
        load_vision_encoder(ckpt)


def test_misshaped_tensor_is_named(hf_tower, tmp_path: Path) -> None:
    tensors = dict(hf_tower.state_dict())
    tensors["merger.mlp.2.weight"] = torch.zeros(95, 256)
    ckpt = _write_checkpoint(tmp_path / "ckpt", tensors, hf_tower.config.to_dict())
    with pytest.raises(CheckpointError, match=r"merger\.mlp\.2\.weight.*\[95, 256\]"):
        load_vision_encoder(ckpt)


def test_checkpoint_without_vision_tower(tmp_path: Path, hf_tower) -> None:
    ckpt = _write_checkpoint(tmp_path / "ckpt", {"lm_head.weight": torch.zeros(2, 2)}, hf_tower.config.to_dict())
    with pytest.raises(CheckpointError, match="patch_embed.proj.weight"):
        load_vision_encoder(ckpt)


def test_identity_is_stable_and_weight_sensitive(tower_checkpoint: Path, encoder: VisionEncoder) -> None:
    other = load_vision_encoder(tower_checkpoint)
    assert other.identity == encoder.identity and encoder.identity.startswith("vision-")
    with torch.no_grad():
        other.blocks[0].attn.proj.bias[0] += 1.0
    other._identity = None  # cached on first use; recompute for the changed weights
    assert other.identity != encoder.identity


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


def test_config_from_transformers_dicts(hf_tower) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLVisionConfig

    bare = VisionEncoderConfig.from_hf_dict(hf_tower.config.to_dict())
    assert bare == VisionEncoderConfig(
        depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=96,
        window_size=WINDOW, fullatt_block_indexes=(1, 3),
    )
    assert (bare.head_dim, bare.patch_dim, bare.merge_unit) == (16, PATCH_DIM, 4)
    top = Qwen2_5_VLConfig(vision_config=hf_tower.config.to_dict()).to_dict()
    assert VisionEncoderConfig.from_hf_dict(top) == bare

    hf_again = Qwen2_5_VLVisionConfig(**bare.to_hf_dict())
    assert hf_again.model_type == "qwen2_5_vl_vision"
    assert VisionEncoderConfig.from_hf_dict(hf_again.to_dict()) == bare
    assert VisionEncoderConfig.from_hf_dict(bare.to_hf_dict()) == bare


def test_config_aliases_and_hub_spelling() -> None:
    hub = {  # the original Qwen2.5-VL hub vision_config spelling
        "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 2,
        "out_hidden_size": 48, "in_chans": 3, "spatial_patch_size": 14, "rope_theta": 500.0,
        "tokens_per_second": 2, "fullatt_block_indexes": [1], "model_type": "qwen2_5_vl",
    }
    cfg = VisionEncoderConfig.from_hf_dict({"model_type": "qwen2_5_vl", "vision_config": hub})
    assert (cfg.depth, cfg.num_heads, cfg.rope_theta, cfg.fullatt_block_indexes) == (2, 2, 500.0, (1,))
    hash(cfg)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_heads": 5}, "not divisible by num_heads"),
        ({"hidden_size": 24, "num_heads": 4}, "multiple of 4"),
        ({"window_size": 50}, "window_size 50"),
        ({"fullatt_block_indexes": [0, 4]}, r"\[4\]"),
        ({"fullatt_block_indexes": 3}, "list of block indexes"),
        ({"hidden_act": "tanh"}, "hidden_act"),
        ({"depth": 0}, "depth"),
        ({"patch_size": [14, 14]}, "patch_size"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "yarn"),
    ],
)
def test_bad_config(changes: dict, message: str) -> None:
    good = {
        "depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 96,
        "fullatt_block_indexes": [1, 3],
    }
    VisionEncoderConfig.from_hf_dict(good)
    with pytest.raises(ConfigError, match=message):
        VisionEncoderConfig.from_hf_dict({**good, **changes})


def test_missing_config_keys_are_named() -> None:
    with pytest.raises(ConfigError, match="intermediate_size, out_hidden_size"):
        VisionEncoderConfig.from_hf_dict({"vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2}})
    with pytest.raises(ConfigError, match="no 'vision_config'"):
        VisionEncoderConfig.from_hf_dict({"model_type": "mimo_v2_flash", "hidden_size": 64})


# ---------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------


def test_check_accepts_good_item_and_counts(encoder: VisionEncoder) -> None:
    item = VisionInput(_pixels((4, 6, 8), seed=0), torch.tensor([4, 6, 8]))
    encoder.check(item)
    assert item.grid_thw == (4, 6, 8)
    assert (item.num_patches, item.num_tokens) == (192, 48)
    assert (encoder.cost(item), encoder.num_tokens(item)) == (192, 48)


@pytest.mark.parametrize(
    ("pixels", "grid", "message"),
    [
        (torch.zeros(15, PATCH_DIM), (1, 4, 4), r"shape \[15, 1176\].*needs \[16, 1176\]"),
        (torch.zeros(16, 588), (1, 4, 4), r"needs \[16, 1176\]"),
        (torch.zeros(16 * PATCH_DIM), (1, 4, 4), r"shape \[18816\]"),
        (torch.zeros(15, PATCH_DIM), (1, 3, 5), "multiples of spatial_merge_size 2"),
        (torch.zeros(0, PATCH_DIM), (0, 4, 4), ">= 1"),
        (torch.zeros(16, PATCH_DIM, dtype=torch.int32), (1, 4, 4), "floating-point"),
        (torch.zeros(16, PATCH_DIM).index_fill_(0, torch.tensor([3]), float("nan")), (1, 4, 4), "NaN"),
        (torch.full((16, PATCH_DIM), float("inf")), (1, 4, 4), "infinite"),
    ],
)
def test_check_rejects(encoder: VisionEncoder, pixels: torch.Tensor, grid, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encoder.check(VisionInput(pixels, grid))


def test_bad_grid_shapes_rejected(encoder: VisionEncoder) -> None:
    with pytest.raises(ValueError, match=r"\(t, h, w\)"):
        VisionInput(torch.zeros(16, PATCH_DIM), (4, 4))
    with pytest.raises(ValueError, match="spatial_merge_size 3"):
        encoder.check(VisionInput(torch.zeros(36, PATCH_DIM), (1, 6, 6), spatial_merge_size=3))
    with pytest.raises(ValueError, match="needs"):
        encoder(torch.zeros(10, PATCH_DIM), [(1, 4, 4)])
