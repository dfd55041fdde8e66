"""Whisper-family audio encoder plus a projector into the LLM's hidden size.

The tower's parameter names are those of transformers' ``WhisperEncoder``, so a
Whisper checkpoint (bare, ``model.encoder.``/``encoder.``-prefixed, or the
``audio_tower.`` of a multimodal checkpoint) loads without renaming.

Every 30 s chunk of every item is encoded in one packed forward: the chunks'
encoder frames are laid end to end and attention is block-diagonal per chunk
(``varlen_attention``), so an item's result never depends on its batch-mates.

Two ways to treat the zero-padded tail of the last chunk:

* ``pad_to_full_chunk=True`` (Whisper-exact): each chunk runs all of its
  ``2 * max_source_positions`` mel frames, attention sees the padding as
  Whisper was trained to, and the outputs are cut back to the valid frames.
* ``pad_to_full_chunk=False``: each chunk runs only its valid mel frames, which
  saves the padding compute but differs from Whisper near the tail.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from encoders.checkpoint import encoder_identity, find_prefix, load_submodule
from encoders.media_kinds import read_config_json
from encoders.varlen import cu_seqlens_from_lengths, varlen_attention
from llm_core.model.config import ConfigError
from llm_core.loading.weights import CheckpointReader
from llm_core.model.meta_build import materialize, meta_build

__all__ = [
    "AudioEncoder",
    "AudioEncoderConfig",
    "AudioInput",
    "AudioProjector",
    "AudioTower",
    "encoder_frames",
    "load_audio_encoder",
]

# Waveform samples per mel frame in Whisper's front end (media.audio.HOP_LENGTH);
# repeated here so the encoder does not import the FFmpeg-backed media module.
WHISPER_HOP_LENGTH = 160

# Where the tower lives in the checkpoint layouts we know, most specific first.
TOWER_PREFIXES = ("audio_tower.", "model.encoder.", "encoder.", "")
PROJECTOR_PREFIX = "audio_projector."

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

_REQUIRED_HF_FIELDS = ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim")


# ---------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class AudioEncoderConfig:
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    layer_norm_eps: float = 1e-5
    # Projector output size (the LLM hidden size); None means no projector.
    out_hidden_size: int | None = None
    # Consecutive encoder frames stacked into one projector token.
    projector_downsample: int = 2
    pad_to_full_chunk: bool = True

    def __post_init__(self) -> None:
        for name in (*_REQUIRED_HF_FIELDS, "num_mel_bins", "max_source_positions", "projector_downsample"):
            _require_positive_int(name, getattr(self, name))
        if self.out_hidden_size is not None:
            _require_positive_int("out_hidden_size", self.out_hidden_size)
        if self.d_model % self.encoder_attention_heads:
            raise ConfigError(
                f"audio encoder d_model={self.d_model} is not divisible by "
                f"encoder_attention_heads={self.encoder_attention_heads}"
            )
        if self.activation_function not in _ACTIVATIONS:
            raise ConfigError(
                f"audio encoder activation_function={self.activation_function!r} is not supported "
                f"(known: {', '.join(sorted(_ACTIVATIONS))})"
            )
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ConfigError(f"audio encoder layer_norm_eps must be in (0, 1), got {eps!r}")
        if not isinstance(self.pad_to_full_chunk, bool):
            raise ConfigError(
                f"audio encoder pad_to_full_chunk must be a bool, got {self.pad_to_full_chunk!r}"
            )

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> AudioEncoderConfig:
        """From a Whisper config dict, or a multimodal config whose ``audio_config`` is one.

        Keys this encoder has no use for (decoder sizes, token ids, ...) are ignored.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"audio encoder config must be a JSON object, got {type(d).__name__}")
        source = d.get("audio_config", d)
        if not isinstance(source, Mapping):
            raise ConfigError(f"'audio_config' must be a JSON object, got {type(source).__name__}")
        missing = [name for name in _REQUIRED_HF_FIELDS if name not in source]
        if missing:
            where = "audio_config" if "audio_config" in d else "config (no 'audio_config', nor Whisper's)"
            raise ConfigError(f"audio encoder {where} lacks {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in source.items() if k in known})

    def to_hf_dict(self) -> dict[str, Any]:
        """Whisper field names (loadable by ``from_hf_dict``), plus the projector/padding fields."""
        return {"model_type": "whisper", **{f.name: getattr(self, f.name) for f in fields(self)}}

    @property
    def chunk_frames(self) -> int:
        """Mel frames per chunk: the stride-2 conv halves them to ``max_source_positions``."""
        return 2 * self.max_source_positions

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def output_size(self) -> int:
        return self.out_hidden_size if self.out_hidden_size is not None else self.d_model


def _require_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; `true` in a JSON config is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"audio encoder {name} must be a positive integer, got {value!r}")


# ---------------------------------------------------------------------------
# Input


def encoder_frames(mel_frames: int) -> int:
    """Encoder frames the stride-2 conv (k3, p1) makes of ``mel_frames`` mel frames."""
    return (mel_frames - 1) // 2 + 1 if mel_frames > 0 else 0


@dataclass(frozen=True, eq=False)
class AudioInput:
    """One audio item: its log-mel chunks and how many mel frames carry audio."""

    features: torch.Tensor  # [chunks, num_mel_bins, chunk_frames], from media.audio_features
    num_frames: int  # mel frames with audio across all chunks; the rest is padding

    @classmethod
    def from_waveform_length(
        cls, features: torch.Tensor, num_samples: int, hop: int = WHISPER_HOP_LENGTH
    ) -> AudioInput:
        """``num_frames`` for a waveform of ``num_samples`` samples: every mel frame whose
        centre sample lies inside the audio (Whisper's attention-mask convention)."""
        if num_samples <= 0 or hop <= 0:
            raise ValueError(f"num_samples ({num_samples}) and hop ({hop}) must be positive")
        capacity = features.shape[0] * features.shape[-1] if features.dim() == 3 else 0
        return cls(features, min(math.ceil(num_samples / hop), capacity))

    @property
    def num_chunks(self) -> int:
        return int(self.features.shape[0])

    def valid_frames_per_chunk(self) -> list[int]:
        """Valid mel frames of each chunk; only the trailing chunk(s) can fall short."""
        size = int(self.features.shape[-1])
        return [min(max(self.num_frames - c * size, 0), size) for c in range(self.num_chunks)]


# ---------------------------------------------------------------------------
# Modules (parameter names follow transformers' WhisperEncoder)


class _SelfAttention(nn.Module):
    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        d = config.d_model
        self.num_heads = config.encoder_attention_heads
        self.scaling = config.head_dim**-0.5
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)  # Whisper's keys have no bias
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
        tokens = x.shape[0]
        # Scaling q before the product (not inside the softmax) is Whisper's order;
        # keeping it keeps float16/bfloat16 rounding the same as the reference.
        q = (self.q_proj(x) * self.scaling).view(tokens, self.num_heads, -1)
        k = self.k_proj(x).view(tokens, self.num_heads, -1)
        v = self.v_proj(x).view(tokens, self.num_heads, -1)
        out = varlen_attention(q, k, v, cu_seqlens, scale=1.0)
        return self.out_proj(out.reshape(tokens, -1))


class _EncoderLayer(nn.Module):
    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn = _SelfAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.activation = _ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens)
        x = x + self.fc2(self.activation(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:
            # Whisper clamps float16 activations so a rare overflow stays finite.
            limit = torch.finfo(torch.float16).max - 1000
            x = x.clamp(-limit, limit)
        return x


class AudioTower(nn.Module):
    """Conv stem, position table and pre-LN transformer of a Whisper encoder."""

    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)

    def embed(self, mel: torch.Tensor) -> torch.Tensor:
        """``[chunks, n_mels, frames]`` -> ``[chunks, encoder_frames(frames), d]`` with positions.

        The conv zero-pads at both ends of ``frames``: callers pass each chunk's
        frames on their own, never several chunks glued along time.
        """
        x = F.gelu(self.conv1(mel))  # the stem's GELU is exact whatever activation_function says
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        return x + self.embed_positions.weight[: x.shape[1]]

    def transform(self, hidden: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
        """The transformer layers over packed ``[tokens, d]`` (no final norm)."""
        for layer in self.layers:
            hidden = layer(hidden, cu_seqlens)
        return hidden


class AudioProjector(nn.Module):
    """Stacked encoder frames -> LLM hidden size: linear_1, GELU, linear_2."""

    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        if config.out_hidden_size is None:
            raise ConfigError("an audio projector needs out_hidden_size")
        self.downsample = config.projector_downsample
        self.linear_1 = nn.Linear(config.d_model * self.downsample, config.out_hidden_size)
        self.linear_2 = nn.Linear(config.out_hidden_size, config.out_hidden_size)

    def forward(self, hidden: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """``hidden``: packed ``[sum(lengths), d]`` encoder frames, one segment per chunk.

        Frames are grouped within a chunk, never across two, and a chunk's short
        tail group is zero-filled, so each chunk gives ``ceil(length / downsample)`` rows.
        """
        n = self.downsample
        padded = [-(-length // n) * n for length in lengths]
        if padded != list(lengths):
            hidden = _scatter_segments(hidden, lengths, padded)
        stacked = hidden.reshape(-1, n * hidden.shape[-1])
        return self.linear_2(F.gelu(self.linear_1(stacked)))


def _segment_rows(starts: Sequence[int], lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row indices ``start .. start + length - 1`` of every segment, concatenated."""
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, lengths)])


def _scatter_segments(hidden: torch.Tensor, lengths: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
    """Packed segments of ``lengths`` rows moved into zeroed slots of ``slots`` rows each."""
    out = hidden.new_zeros((sum(slots), hidden.shape[-1]))
    index = _segment_rows(cu_seqlens_from_lengths(slots)[:-1], lengths, hidden.device)
    return out.index_copy_(0, index, hidden)


# ---------------------------------------------------------------------------
# Encoder


class AudioEncoder(nn.Module):
    kind: ClassVar[str] = "audio"

    def __init__(self, config: AudioEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.tower = AudioTower(config)
        self.projector = AudioProjector(config) if config.out_hidden_size is not None else None

    # -- per-item bookkeeping -------------------------------------------------

    def check(self, item: AudioInput) -> None:
        """Raise ``ValueError`` naming what is wrong with ``item``; pass silently otherwise."""
        self._check_layout(item)
        if not all(bool(torch.isfinite(f).all()) for f in self._used_features(item)):
            raise ValueError("audio features contain NaN or infinite values")

    def _used_features(self, item: AudioInput) -> list[torch.Tensor]:
        """The ``[n_mels, frames]`` slice of each chunk the forward reads: whole chunks
        in pad mode (attention sees the padding), the valid frames otherwise."""
        valid = [v for v in item.valid_frames_per_chunk() if v > 0]
        if self.config.pad_to_full_chunk:
            return [item.features[c] for c in range(len(valid))]
        return [item.features[c, :, :v] for c, v in enumerate(valid)]

    def _check_layout(self, item: AudioInput) -> None:
        # The shape/range checks only: cheap enough for num_tokens and cost.
        feats = item.features
        cfg = self.config
        if not isinstance(feats, torch.Tensor):
            raise ValueError(f"audio features must be a tensor, got {type(feats).__name__}")
        if feats.dim() != 3:
            raise ValueError(
                f"audio features must be [chunks, {cfg.num_mel_bins}, {cfg.chunk_frames}], "
                f"got {feats.dim()}-D shape {tuple(feats.shape)}"
            )
        chunks, mels, frames = feats.shape
        if chunks == 0:
            raise ValueError("audio features have no chunks")
        if mels != cfg.num_mel_bins:
            raise ValueError(f"audio features have {mels} mel bins, the encoder expects {cfg.num_mel_bins}")
        if frames != cfg.chunk_frames:
            raise ValueError(
                f"audio chunks have {frames} mel frames, the encoder expects {cfg.chunk_frames} "
                f"(2 * max_source_positions)"
            )
        if not feats.is_floating_point():
            raise ValueError(f"audio features must be floating point, got {feats.dtype}")
        num = item.num_frames
        if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= chunks * frames:
            raise ValueError(
                f"audio num_frames={num!r} is outside 1..{chunks * frames} "
                f"({chunks} chunks of {frames} frames)"
            )

    def _encoder_lengths(self, item: AudioInput) -> list[int]:
        """Encoder frames kept from each chunk that carries audio."""
        self._check_layout(item)
        return [encoder_frames(v) for v in item.valid_frames_per_chunk() if v > 0]

    def cost(self, item: AudioInput) -> int:
        """Encoder frames actually computed for ``item`` (padding included in pad mode)."""
        lengths = self._encoder_lengths(item)
        if self.config.pad_to_full_chunk:
            return len(lengths) * self.config.max_source_positions
        return sum(lengths)

    def num_tokens(self, item: AudioInput) -> int:
        """Rows ``encode_batch`` returns for ``item``."""
        return sum(self._tokens_per_chunk(self._encoder_lengths(item)))

    def _tokens_per_chunk(self, lengths: Sequence[int]) -> list[int]:
        if self.projector is None:
            return list(lengths)
        n = self.config.projector_downsample
        return [-(-length // n) for length in lengths]

    # -- forward --------------------------------------------------------------

    def forward_chunks(self, features: torch.Tensor, valid_frames: Sequence[int]) -> torch.Tensor:
        """Tower output (after the final norm) for packed chunks.

        ``features``: ``[chunks, n_mels, chunk_frames]``; ``valid_frames``: each
        chunk's mel frames with audio (all > 0). Returns ``[sum(e_c), d_model]``,
        chunk after chunk, with ``e_c = encoder_frames(valid_frames[c])`` rows each.
        """
        if len(valid_frames) != features.shape[0] or min(valid_frames, default=1) <= 0:
            raise ValueError(f"valid_frames {list(valid_frames)} do not describe {features.shape[0]} chunks")
        lengths = [encoder_frames(v) for v in valid_frames]
        if self.config.pad_to_full_chunk:
            hidden = self._forward_full_chunks(features, lengths)
        else:
            chunks = [features[c, :, :v] for c, v in enumerate(valid_frames)]
            hidden = self._forward_trimmed_chunks(chunks, lengths)
        # LayerNorm is per row, so normalising only the kept rows changes nothing.
        return self.tower.layer_norm(hidden)

    def _forward_full_chunks(self, features: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        positions = self.config.max_source_positions
        hidden = self.tower.embed(features).reshape(-1, self.config.d_model)
        hidden = self.tower.transform(hidden, cu_seqlens_from_lengths([positions] * len(lengths)))
        if all(n == positions for n in lengths):
            return hidden
        starts = [c * positions for c in range(len(lengths))]
        return hidden.index_select(0, _segment_rows(starts, lengths, hidden.device))

    def _forward_trimmed_chunks(self, chunks: Sequence[torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
        """``chunks``: each chunk's valid ``[n_mels, v]`` frames."""
        hidden = self._stem_packed(chunks, lengths)
        return self.tower.transform(hidden, cu_seqlens_from_lengths(lengths))

    def _stem_packed(self, chunks: Sequence[torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
        """The conv stem of every chunk's valid frames in one pair of conv calls.

        Chunks are laid end to end on one time axis, each at an even offset and
        followed by at least one zero frame. That zero frame stands in for the conv's
        edge padding on both sides of a boundary (the first conv's output there is
        zeroed again before the second conv), and even offsets keep the stride-2 grid
        of the second conv aligned to each chunk's start: each chunk's rows equal
        stemming it alone.
        """
        offsets, end = [], 0
        for chunk in chunks:
            offsets.append(end)
            end = end + chunk.shape[-1] + 1
            end += end % 2
        total = offsets[-1] + chunks[-1].shape[-1]
        first = chunks[0]
        mel = first.new_zeros((1, first.shape[0], total))
        live = torch.zeros(total, dtype=torch.bool, device=first.device)
        for o, chunk in zip(offsets, chunks):
            mel[0, :, o : o + chunk.shape[-1]] = chunk
            live[o : o + chunk.shape[-1]] = True
        x = F.gelu(self.tower.conv1(mel)) * live
        x = F.gelu(self.tower.conv2(x))[0].transpose(0, 1)  # [ceil(total / 2), d]
        rows = _segment_rows([o // 2 for o in offsets], lengths, x.device)
        positions = _segment_rows([0] * len(lengths), lengths, x.device)
        return x.index_select(0, rows) + self.tower.embed_positions.weight.index_select(0, positions)

    def encode_batch(self, items: Sequence[AudioInput]) -> list[torch.Tensor]:
        """Encode every chunk of every item in one packed forward (inference).

        Returns one ``[num_tokens(item), out_hidden_size or d_model]`` tensor per item.
        """
        for item in items:
            self.check(item)
        with torch.inference_mode():
            return self.forward_items(items)

    def forward_items(self, items: Sequence[AudioInput]) -> list[torch.Tensor]:
        """``encode_batch`` without checks or inference mode: the differentiable path training uses."""
        if not items:
            return []
        weight = self.tower.conv1.weight
        per_item_valid = [[v for v in item.valid_frames_per_chunk() if v > 0] for item in items]
        # Trailing chunks without audio (possible when num_frames is short) are never run.
        valid = [v for item_valid in per_item_valid for v in item_valid]
        lengths = [encoder_frames(v) for v in valid]
        if self.config.pad_to_full_chunk:
            features = torch.cat([item.features[: len(v)] for item, v in zip(items, per_item_valid)])
            hidden = self.forward_chunks(features.to(device=weight.device, dtype=weight.dtype), valid)
        else:
            # Only the valid frames are copied: a 2 s clip does not drag its 28 s of padding along.
            used = [f for it in items for f in self._used_features(it)]
            chunks = [f.to(device=weight.device, dtype=weight.dtype) for f in used]
            hidden = self.tower.layer_norm(self._forward_trimmed_chunks(chunks, lengths))
        if self.projector is not None:
            hidden = self.projector(hidden, lengths)
        per_item = [sum(self._tokens_per_chunk([encoder_frames(v) for v in iv])) for iv in per_item_valid]
        return list(hidden.split(per_item))

    @functools.cached_property
    def identity(self) -> str:
        """Config + weight hash; computed on first use, so ask only after loading weights."""
        return encoder_identity(self.kind, self.config, self)


# ---------------------------------------------------------------------------
# Loading


def load_audio_encoder(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> AudioEncoder:
    """An ``AudioEncoder`` with weights from ``model_dir`` (config.json + safetensors)."""
    config = AudioEncoderConfig.from_hf_dict(read_config_json(model_dir))
    # Built without random init: load_submodule overwrites every parameter.
    with meta_build():
        encoder = AudioEncoder(config)
    materialize(encoder, device, dtype)
    with CheckpointReader(model_dir) as reader:
        load_submodule(encoder.tower, reader, find_prefix(reader, TOWER_PREFIXES, "conv1.weight"))
        if encoder.projector is not None:
            load_submodule(encoder.projector, reader, PROJECTOR_PREFIX)
    return encoder.eval().requires_grad_(False)
