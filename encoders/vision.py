"""Vision encoder of the Qwen2.5-VL family (the ViT MiMo-VL models use).

Numerically it is ``transformers``' ``Qwen2_5_VisionTransformerPretrainedModel``, with
the same parameter names, so checkpoints load unchanged. The pipeline, per item (an
image, or a video clip of ``t`` temporal patches):

1. patch embedding: one linear map of each flattened ``[C, T, P, P]`` patch (what the
   strided Conv3d computes), so every patch row is independent of the others;
2. reorder the patches, in groups of one merge unit (``merge x merge`` patches), so that
   each attention window is contiguous; windows tile every frame row-major and the
   right/bottom ones may be partial;
3. transformer blocks with 2-D axial rotary embeddings: most attend within windows,
   those in ``fullatt_block_indexes`` within whole frames (never across frames);
4. patch merger (RMSNorm, concatenate the ``merge²`` patches of a unit, MLP) and the
   inverse reorder, giving one output token per merge unit in raster order.

Many items are packed into one forward pass. All attention is block-diagonal over
``cu_seqlens`` (``varlen_attention``), so an item's output depends only on that item:
encoding it inside a batch or alone gives the same result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from encoders.checkpoint import encoder_identity, find_prefix, load_submodule
from encoders.media_kinds import read_config_json
from encoders.varlen import cu_seqlens_from_lengths, varlen_attention
from llm_core.model.config import ConfigError
from llm_core.model.layers import RMSNorm
from llm_core.loading.weights import CheckpointReader
from llm_core.model.meta_build import materialize, meta_build

__all__ = ["VisionEncoder", "VisionEncoderConfig", "VisionInput", "load_vision_encoder"]

HF_MODEL_TYPE = "qwen2_5_vl_vision"
# Where Qwen2.5-VL-style checkpoints keep the vision tower: hub files, transformers
# re-saves, and a bare tower saved on its own.
CHECKPOINT_PREFIXES = ("visual.", "model.visual.", "")

_REQUIRED_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
# Other spellings of our field names found in config.json files: transformers'
# attribute_map aliases and the original Qwen2.5-VL hub vision_config.
_KEY_ALIASES = {
    "num_attention_heads": "num_heads",
    "num_hidden_layers": "depth",
    "in_chans": "in_channels",
    "spatial_patch_size": "patch_size",
}


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# The hidden_act names transformers' ACT2FN maps to these functions.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
}


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionEncoderConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    # Window side in pixels; a multiple of one merge unit (patch_size * spatial_merge_size).
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not isinstance(self.fullatt_block_indexes, (list, tuple)):
            raise ConfigError(
                f"vision config: fullatt_block_indexes must be a list of block indexes, "
                f"got {self.fullatt_block_indexes!r}"
            )
        # A list here (e.g. straight from JSON) would make the frozen config unhashable.
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        self._validate()

    def _validate(self) -> None:
        for name in (
            "depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
            "in_channels", "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"vision config: {name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"vision config: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.head_dim % 4:
            # The axial rope splits each half of the head between the h and w axes.
            raise ConfigError(f"vision config: head_dim {self.head_dim} must be a multiple of 4 for 2-D rope")
        unit_px = self.patch_size * self.spatial_merge_size
        if self.window_size % unit_px:
            raise ConfigError(
                f"vision config: window_size {self.window_size} must be a multiple of "
                f"patch_size * spatial_merge_size = {unit_px}"
            )
        bad = [i for i in self.fullatt_block_indexes if not isinstance(i, int) or not 0 <= i < self.depth]
        if bad:
            raise ConfigError(
                f"vision config: fullatt_block_indexes {bad} are outside the {self.depth} blocks [0, {self.depth})"
            )
        if not isinstance(self.hidden_act, str) or self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(
                f"vision config: hidden_act {self.hidden_act!r} is not one of {sorted(_ACTIVATIONS)}"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"vision config: {name} must be a positive number, got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def window_units(self) -> int:
        """Window side counted in merge units."""
        return self.window_size // (self.patch_size * self.spatial_merge_size)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> VisionEncoderConfig:
        """From a Qwen2.5-VL ``config.json`` (its ``vision_config``) or a bare vision config."""
        src = d.get("vision_config", d)
        if not isinstance(src, Mapping):
            raise ConfigError(f"vision_config must be a JSON object, got {type(src).__name__}")
        values = {_KEY_ALIASES.get(k, k): v for k, v in src.items() if k in _KEY_ALIASES}
        values.update(src)  # a canonical key wins over its alias
        missing = [k for k in _REQUIRED_KEYS if k not in values]
        if missing:
            where = "vision_config" if "vision_config" in d else "config (which has no 'vision_config')"
            raise ConfigError(f"vision encoder {where} is missing {', '.join(missing)}")
        values["rope_theta"] = _rope_theta(values)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def to_hf_dict(self) -> dict[str, Any]:
        """A dict ``transformers.Qwen2_5_VLVisionConfig(**d)`` accepts."""
        return {
            "model_type": HF_MODEL_TYPE,
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "out_hidden_size": self.out_hidden_size,
            "in_channels": self.in_channels,
            "patch_size": self.patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "window_size": self.window_size,
            "fullatt_block_indexes": list(self.fullatt_block_indexes),
            "hidden_act": self.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
            # transformers hard-codes 1e-6 and ignores the key; kept for the round trip.
            "rms_norm_eps": self.rms_norm_eps,
        }


def _rope_theta(values: Mapping[str, Any]) -> float:
    rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"vision config: rope_parameters must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in (None, "axial", "default"):
        raise ConfigError(f"vision config: only plain axial rope is supported, not rope_type {rope_type!r}")
    theta = rope.get("rope_theta", values.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"vision config: rope_theta must be a number, got {theta!r}")
    return float(theta)


# ---------------------------------------------------------------------------------------
# Inputs and pack layout
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionInput:
    """One image (``t == 1``) or one video clip (``t`` = frames / temporal_patch_size)."""

    pixel_values: torch.Tensor  # [t*h*w, patch_dim], transformers' patch layout
    grid_thw: tuple[int, int, int]
    # Needed to count output tokens without the encoder; check() insists it matches.
    spatial_merge_size: int = 2

    def __post_init__(self) -> None:
        grid = self.grid_thw.tolist() if isinstance(self.grid_thw, torch.Tensor) else list(self.grid_thw)
        if len(grid) != 3:
            raise ValueError(f"vision input: grid_thw must be (t, h, w), got {grid}")
        object.__setattr__(self, "grid_thw", tuple(int(x) for x in grid))

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        return self.num_patches // (self.spatial_merge_size * self.spatial_merge_size)


@functools.lru_cache(maxsize=256)
def _frame_layout(h: int, w: int, merge: int, window: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Window layout of one ``h x w``-patch frame (the same for every frame of every item
    of that size; cached, never mutated).

    Returns the merge-unit permutation that makes windows contiguous (units in raster
    order inside each window, windows row-major), the ``[h*w, 2]`` (row, col) patch
    positions in that order, and the window lengths in patches.
    """
    gh, gw = h // merge, w // merge
    unit_row = torch.arange(gh).repeat_interleave(gw)
    unit_col = torch.arange(gw).repeat(gh)
    windows_per_row = -(-gw // window)
    window_id = (unit_row // window) * windows_per_row + unit_col // window
    # Stable: keeps raster order among the units of one window.
    order = torch.argsort(window_id, stable=True)
    lengths = tuple(torch.bincount(window_id).mul(merge * merge).tolist())

    # Patches of a unit are its merge x merge block, row-major.
    in_unit = torch.arange(merge)
    rows = (unit_row[order] * merge)[:, None, None] + in_unit[None, :, None]
    cols = (unit_col[order] * merge)[:, None, None] + in_unit[None, None, :]
    positions = torch.stack(torch.broadcast_tensors(rows, cols), dim=-1).reshape(h * w, 2)
    return order, positions, lengths


@dataclass(frozen=True)
class _PackLayout:
    """Index metadata for one packed forward over many items."""

    unit_order: torch.Tensor  # [units] merge-unit permutation, raster -> windowed
    positions: torch.Tensor  # [patches, 2] (row, col) of each patch, windowed order
    cu_windows: list[int]  # window boundaries, windowed order
    cu_frames: list[int]  # frame boundaries (the same in both orders)


def _pack_layout(grids: Sequence[tuple[int, int, int]], config: VisionEncoderConfig) -> _PackLayout:
    merge = config.spatial_merge_size
    orders: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    window_lengths: list[int] = []
    frame_lengths: list[int] = []
    unit_offset = 0
    for t, h, w in grids:
        order, frame_positions, lengths = _frame_layout(h, w, merge, config.window_units)
        units = (h // merge) * (w // merge)
        # Windows never cross frames: frame f's units come as a block, in frame order.
        frame_starts = unit_offset + units * torch.arange(t)
        orders.append((frame_starts[:, None] + order[None, :]).reshape(-1))
        positions.append(frame_positions.repeat(t, 1))
        window_lengths += lengths * t
        frame_lengths += [h * w] * t
        unit_offset += units * t
    return _PackLayout(
        unit_order=torch.cat(orders),
        positions=torch.cat(positions),
        cu_windows=cu_seqlens_from_lengths(window_lengths),
        cu_frames=cu_seqlens_from_lengths(frame_lengths),
    )


# ---------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------


class _PatchEmbed(nn.Module):
    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        # A Conv3d only to own the weight under its checkpoint name and shape.
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # kernel == stride and each row is one whole patch, so the conv is a matmul with
        # the flattened kernel; as a matmul, a row's result cannot depend on its batch.
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))


class _AxialRotary(nn.Module):
    """2-D rope: half of each head rotates with the patch row, half with the column."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.theta = config.rope_theta
        self.axis_dim = config.head_dim // 2  # rotary width given to each axis
        # Computed on the CPU when the module is built on meta (meta_build): meta
        # arange runs torch's Python reference, a second's import on first use,
        # and _apply recomputes the buffer wherever the module goes anyway.
        default = torch.get_default_device()
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu") if default.type == "meta" else default),
                             persistent=False)

    def _inv_freq(self, device: torch.device | None) -> torch.Tensor:
        exponents = torch.arange(0, self.axis_dim, 2, dtype=torch.float32, device=device) / self.axis_dim
        return 1.0 / (self.theta**exponents)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> _AxialRotary:
        # .to(bfloat16) would round the frequencies (angle errors of tenths of a radian at
        # large positions) and to_empty() leaves garbage: always recompute in float32.
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions: [n, 2]`` (row, col) -> float32 ``cos, sin: [n, head_dim]``."""
        angles = positions.float()[:, :, None] * self.inv_freq  # [n, 2, head_dim // 4]
        # [row freqs | col freqs], twice: the two halves that rotate_half pairs up.
        angles = angles.flatten(1).repeat(1, 2)
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x: [n, heads, head_dim]``, rotated in float32 and returned in its own dtype."""
    x32 = x.float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.scale = config.head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, -1)
        # q and k rotated together: one pass of the elementwise ops instead of two.
        qk = _apply_rotary(qkv[:, :2].reshape(n, 2 * self.num_heads, -1), *rope)
        q, k = qk.view(n, 2, self.num_heads, -1).unbind(1)
        v = qkv[:, 2]
        out = varlen_attention(q, k, v, cu_seqlens, scale=self.scale)
        return self.proj(out.reshape(n, -1))


class _GatedMLP(nn.Module):
    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = _Attention(config)
        self.mlp = _GatedMLP(config)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """Each merge unit's patches -> one token of out_hidden_size."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        merged_dim = config.hidden_size * config.merge_unit
        self.ln_q = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Sequential for the checkpoint names mlp.0 / mlp.2; the GELU is the exact one.
        self.mlp = nn.Sequential(
            nn.Linear(merged_dim, merged_dim), nn.GELU(), nn.Linear(merged_dim, config.out_hidden_size)
        )
        self.merged_dim = merged_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged_dim))


# ---------------------------------------------------------------------------------------
# Encoder
# ---------------------------------------------------------------------------------------


def _grid_list(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(g) for g in grid_thw]
    if any(len(r) != 3 for r in rows):
        raise ValueError(f"grid_thw must hold (t, h, w) rows, got {rows}")
    return [(int(t), int(h), int(w)) for t, h, w in rows]


class VisionEncoder(nn.Module):
    kind = "vision"

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = _PatchEmbed(config)
        self.rotary_pos_emb = _AxialRotary(config)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.depth))
        self.merger = _PatchMerger(config)
        self._full_attention_blocks = frozenset(config.fullatt_block_indexes)
        self._identity: str | None = None

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Packed items (patches concatenated in item order) -> ``[sum(num_tokens), out_hidden_size]``."""
        grids = _grid_list(grid_thw)
        self._check_pack(pixel_values, grids)
        if not grids:
            return pixel_values.new_zeros((0, self.config.out_hidden_size), dtype=self._dtype)
        layout = _pack_layout(grids, self.config)
        device = pixel_values.device
        unit_order = layout.unit_order.to(device)

        x = self._to_windowed(self.patch_embed(pixel_values), unit_order)
        rope = self.rotary_pos_emb(layout.positions.to(device))
        for i, block in enumerate(self.blocks):
            cu = layout.cu_frames if i in self._full_attention_blocks else layout.cu_windows
            x = block(x, rope, cu)
        merged = self.merger(x)
        # Back to raster order: the unit that went to slot j came from unit_order[j].
        out = torch.empty_like(merged)
        out[unit_order] = merged
        return out

    def _to_windowed(self, x: torch.Tensor, unit_order: torch.Tensor) -> torch.Tensor:
        unit = self.config.merge_unit
        return x.view(-1, unit, x.shape[-1])[unit_order].reshape(-1, x.shape[-1])

    def _check_pack(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
        cfg = self.config
        patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (patches, cfg.patch_dim):
            raise ValueError(
                f"pixel_values has shape {list(pixel_values.shape)}, but grid_thw {grids} needs "
                f"[{patches}, {cfg.patch_dim}]"
            )
        merge = cfg.spatial_merge_size
        for t, h, w in grids:
            if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
                raise ValueError(
                    f"grid_thw {(t, h, w)} is not a positive grid with h and w divisible by "
                    f"spatial_merge_size {merge}"
                )

    @property
    def _dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def _device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def check(self, item: VisionInput) -> None:
        """Raise ``ValueError`` saying why ``item`` cannot be encoded by this encoder."""
        cfg = self.config
        t, h, w = item.grid_thw
        if item.spatial_merge_size != cfg.spatial_merge_size:
            raise ValueError(
                f"vision input was made for spatial_merge_size {item.spatial_merge_size}, "
                f"but the encoder merges {cfg.spatial_merge_size}"
            )
        if t < 1 or h < 1 or w < 1:
            raise ValueError(f"vision input grid_thw {item.grid_thw} must have t, h and w >= 1")
        merge = cfg.spatial_merge_size
        if h % merge or w % merge:
            raise ValueError(
                f"vision input grid_thw {item.grid_thw}: h and w must be multiples of "
                f"spatial_merge_size {merge} (the image side must be a multiple of "
                f"{cfg.patch_size * merge} pixels)"
            )
        pv = item.pixel_values
        if not isinstance(pv, torch.Tensor) or not pv.is_floating_point():
            what = f"a {pv.dtype} tensor" if isinstance(pv, torch.Tensor) else type(pv).__name__
            raise ValueError(f"vision input pixel_values must be a floating-point tensor, got {what}")
        expected = (item.num_patches, cfg.patch_dim)
        if tuple(pv.shape) != expected:
            raise ValueError(
                f"vision input pixel_values has shape {list(pv.shape)}, but grid_thw {item.grid_thw} "
                f"needs {list(expected)}: t*h*w patches of in_channels*temporal_patch_size*"
                f"patch_size^2 = {cfg.patch_dim} values"
            )
        if not bool(torch.isfinite(pv).all()):
            raise ValueError("vision input pixel_values contains NaN or infinite values")

    def cost(self, item: VisionInput) -> int:
        return item.num_patches

    def num_tokens(self, item: VisionInput) -> int:
        return item.num_patches // self.config.merge_unit

    def encode_batch(self, items: Sequence[VisionInput]) -> list[torch.Tensor]:
        """Encode items in one packed forward; one ``[num_tokens, out_hidden_size]`` each."""
        with torch.inference_mode():
            pieces = self.forward_items(items)
            if len(pieces) <= 1:
                return pieces
            # Separate storage, so a cached item does not keep the whole pack alive.
            return [p.clone() for p in pieces]

    def forward_items(self, items: Sequence[VisionInput]) -> list[torch.Tensor]:
        """One packed forward, split per item, without inference mode (training uses it)."""
        if not items:
            return []
        dtype, device = self._dtype, self._device
        pixels = torch.cat([it.pixel_values.to(device=device, dtype=dtype) for it in items])
        out = self.forward(pixels, [it.grid_thw for it in items])
        return list(out.split([self.num_tokens(it) for it in items]))

    @property
    def identity(self) -> str:
        if self._identity is None:
            self._identity = encoder_identity(self.kind, self.config, self)
        return self._identity


def load_vision_encoder(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> VisionEncoder:
    """The vision tower of the checkpoint in ``model_dir`` (config.json + safetensors)."""
    config = VisionEncoderConfig.from_hf_dict(read_config_json(model_dir))
    with CheckpointReader(model_dir) as reader:
        prefix = find_prefix(reader, CHECKPOINT_PREFIXES, "patch_embed.proj.weight")
        # Built on meta: random init of weights about to be overwritten is wasted time.
        with meta_build():
            encoder = VisionEncoder(config)
        materialize(encoder, device, dtype)
        load_submodule(encoder, reader, prefix)
    return encoder.eval()
