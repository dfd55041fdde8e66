"""Loading a checkpoint into the model, one tensor at a time; saving one.

The model is built on the meta device and each of its matrices is filled from
the checkpoint tensors that hold it, read piece by piece
(``checkpoint_reader``): peak memory is the model plus the tensor in flight.
The layouts in the wild are mapped onto this model's modules:

* per-expert ``mlp.experts.E.{gate,up,down}_proj.weight`` (the hub's) or the
  stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` (transformers');
* separate ``self_attn.{q,k,v}_proj`` (MiMo-V2-Flash), or the fused
  ``self_attn.qkv_proj`` of MiMo-V2.5 (``attention_projection_layout:
  fused_qkv``), stored as one ``[q | k | v]`` chunk per tensor-parallel rank of
  the export, ``num_key_value_heads`` of them, each chunk quantized on its own;
* ``attention_sink_bias`` for sinks; a tied LM head.

FP8 matrices (``fp8.py``) are dequantized to the run dtype, or kept FP8 in
memory (``fp8_linear``) where FP8 GEMMs run: ``quantization="auto"`` keeps them
on CUDA devices of compute capability 8.9 and up, ``"fp8"`` always (a float
checkpoint is then quantized at load in 128x128 blocks), ``"none"`` never.

Every tensor of the checkpoint must be used, or be one of these known extras:

* ``rotary_emb.inv_freq`` / ``cos_cached`` / ``sin_cached`` (computed here);
* MTP layers past ``num_nextn_predict_layers`` (fewer draft layers chosen);
* tensors outside the LLM's names (``model.layers.*``, ``model.mtp.*``,
  ``model.embed_tokens.*``, ``model.norm.*``, ``lm_head.*``) when config.json
  declares a ``vision_config`` or ``audio_config``: the encoders load and
  check those;
* KV-cache scales (``self_attn.k_scale`` / ``v_scale`` / ``kv_scale``,
  ``k_proj.k_scale`` / ``v_proj.v_scale``) and static activation scales
  (``input_scale``), read and checked; the latter are not used, the FP8 GEMMs
  scale activations per token group instead.

Anything else is a ``CheckpointError`` naming the tensor.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from llm_core.loading.checkpoint_reader import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, CheckpointError, CheckpointReader
from llm_core.model.config import AttentionSpec, ConfigError, ModelConfig
from llm_core.model.expert_parallel import ExpertParallel
from llm_core.model.fp8 import Fp8Scheme, block_scale_rows, dequantize, never_quantized, quantize_blockwise, read_fp8_scheme
from llm_core.model.fp8_linear import Fp8Linear, Fp8RoutedExperts, fp8_gemm_supported, resident_weight_bytes
from llm_core.model.layers import RoutedExperts, SparseMoE, empty_k_major
from llm_core.model.meta_build import meta_build
from llm_core.model.model import Attention, MiMoV2ForCausalLM

log = logging.getLogger(__name__)

QuantizationMode = Literal["auto", "fp8", "none"]
QUANTIZATION_MODES = ("auto", "fp8", "none")
# Parameters kept in float32 whatever the model dtype (the router decides ties).
FLOAT32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
_KNOWN_EXTRAS = re.compile(r"\.rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_LLM_NAMES = re.compile(r"^(model\.(layers|mtp|embed_tokens|norm)\.|lm_head\.)")
_TOWER_CONFIGS = ("vision_config", "audio_config")
_KV_SCALE_NAMES = {"k_scale": ("k_scale", "kv_scale", "k_proj.k_scale"),
                   "v_scale": ("v_scale", "kv_scale", "v_proj.v_scale")}
_ONLINE_BLOCK = (128, 128)  # what `quantization="fp8"` quantizes a float checkpoint in


@dataclass(frozen=True)
class Piece:
    """Consecutive rows of one model matrix, read from rows of one checkpoint
    matrix (expert ``expert`` of a stacked one)."""

    name: str
    rows: range  # of the source matrix
    shape: tuple[int, int]  # of the source matrix (per expert)
    chunks: int = 1  # row chunks it was quantized as, one at a time
    expert: int | None = None
    experts: int | None = None  # leading size of a stacked source

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.shape if self.experts is None else (self.experts, *self.shape)

    @property
    def module(self) -> str:
        """The checkpoint module this tensor belongs to (what ignore lists name)."""
        return self.name.removesuffix(".weight") if self.name.endswith(".weight") else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Matrix:
    """A model matrix as read: float values, or FP8 values with their scale table
    [S, ceil(K / group_k)] and table row of each row."""

    values: torch.Tensor
    scale: torch.Tensor | None = None
    scale_row: torch.Tensor | None = None
    group_k: int = 0

    def dense(self) -> torch.Tensor:
        if self.scale is None:
            return self.values
        assert self.scale_row is not None
        return dequantize(self.values, self.scale, self.scale_row, self.group_k)


# ------------------------------------------------------------------- layout
@dataclass(frozen=True)
class CheckpointLayout:
    """What config.json says of the tensors beyond the architecture."""

    qkv_chunks: int | None  # fused qkv_proj: chunks (export TP ranks); None: separate q/k/v
    has_towers: bool  # vision/audio encoders live beside the LLM

    @staticmethod
    def read(data: dict[str, Any], config: ModelConfig) -> CheckpointLayout:
        layout = data.get("attention_projection_layout")
        if layout not in (None, "split", "separate", "fused_qkv"):
            raise ConfigError(f"attention_projection_layout {layout!r} is not supported ('fused_qkv' or absent)")
        chunks = None
        if layout == "fused_qkv":
            # The published V2.5 files are split for this many TP ranks.
            chunks = config.full_attention.num_kv_heads
            for kind in config.used_layer_types:
                spec = config.attention_for(kind)
                if spec.num_heads % chunks or spec.num_kv_heads % chunks:
                    raise ConfigError(f"a fused qkv_proj comes in num_key_value_heads={chunks} chunks, which do not "
                                      f"split the {kind} layers' {spec.num_heads} query / {spec.num_kv_heads} KV heads")
            if config.attention_bias:
                raise ConfigError("a fused qkv_proj with attention_bias is not supported")
        return CheckpointLayout(chunks, any(key in data for key in _TOWER_CONFIGS))


def read_config(model_dir: str | Path, reader: CheckpointReader) -> ModelConfig:
    """config.json, with the MTP depth taken from the weights when it does not say."""
    config = ModelConfig.from_json_file(Path(model_dir) / CONFIG_FILE)
    if config.num_mtp_layers == 0 and (found := reader.mtp_layer_count()):
        config = config.with_mtp_layers(found)
    return config


def _read_config_json(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / CONFIG_FILE).read_text())


# ------------------------------------------------------------------ planning
class _Planner:
    """Which checkpoint pieces hold each matrix of the model."""

    def __init__(self, reader: CheckpointReader, config: ModelConfig, layout: CheckpointLayout) -> None:
        self.reader, self.config, self.layout = reader, config, layout

    def linear(self, module: str, out_features: int, in_features: int) -> tuple[Piece, ...]:
        reader = self.reader
        head, _, proj = module.rpartition(".")
        if self.layout.qkv_chunks and proj in ("q_proj", "k_proj", "v_proj") and head.endswith("self_attn"):
            return self._fused_qkv(head, proj, in_features)
        name = f"{module}.weight"
        if name not in reader:
            if module == "lm_head" and self.config.tie_word_embeddings:
                name = "model.embed_tokens.weight"
            elif proj in ("q_proj", "k_proj", "v_proj") and f"{head}.qkv_proj.weight" in reader:
                raise CheckpointError(f"checkpoint {reader.model_dir} has a fused '{head}.qkv_proj.weight' but no "
                                      f"'{name}': config.json must say attention_projection_layout 'fused_qkv'")
        return (Piece(name, range(out_features), (out_features, in_features)),)

    def _fused_qkv(self, attention: str, proj: str, hidden: int) -> tuple[Piece, ...]:
        chunks = self.layout.qkv_chunks
        assert chunks
        spec = self.config.sliding_attention if ".mtp." in attention else self._spec_of(attention)
        q, k, v = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                   spec.num_kv_heads * spec.v_head_dim)
        per_chunk = (q + k + v) // chunks
        start, length = {"q_proj": (0, q), "k_proj": (q, k), "v_proj": (q + k, v)}[proj]
        start, length = start // chunks, length // chunks
        name = f"{attention}.qkv_proj.weight"
        return tuple(Piece(name, range(c * per_chunk + start, c * per_chunk + start + length),
                           (chunks * per_chunk, hidden), chunks) for c in range(chunks))

    def _spec_of(self, attention: str) -> AttentionSpec:
        return self.config.attention(int(attention.split(".")[2]))  # model.layers.N.self_attn

    def experts(self, prefix: str, expert: int, hidden: int, intermediate: int
                ) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
        """(gate_up pieces, down pieces) of one expert of ``prefix`` (``...mlp.experts``)."""
        stacked = f"{prefix}.gate_up_proj"
        if stacked in self.reader:
            e = self.config.n_routed_experts
            return ((Piece(stacked, range(2 * intermediate), (2 * intermediate, hidden), 1, expert, e),),
                    (Piece(f"{prefix}.down_proj", range(hidden), (hidden, intermediate), 1, expert, e),))
        one = f"{prefix}.{expert}"
        return ((Piece(f"{one}.gate_proj.weight", range(intermediate), (intermediate, hidden)),
                 Piece(f"{one}.up_proj.weight", range(intermediate), (intermediate, hidden))),
                (Piece(f"{one}.down_proj.weight", range(hidden), (hidden, intermediate)),))

    def other_experts(self, prefix: str, owned: range) -> list[str]:
        """Tensors of the experts another rank holds (per-expert layout only)."""
        if f"{prefix}.gate_up_proj" in self.reader:
            return []
        names = [f"{prefix}.{e}.{p}_proj.weight" for e in range(self.config.n_routed_experts) if e not in owned
                 for p in ("gate", "up", "down")]
        scheme = self.reader.fp8
        return names + [self.reader.scale_name(n) for n in names
                        if scheme is not None and n in self.reader and self.reader.is_fp8(n)]


def _all_fp8(reader: CheckpointReader, pieces: tuple[Piece, ...]) -> bool:
    return all(_checked_fp8(reader, piece) for piece in pieces)


def _checked_fp8(reader: CheckpointReader, piece: Piece) -> bool:
    """Whether the piece's source is FP8, after checking its shape and that the
    config does not list its module as kept unquantized."""
    reader.check_shape(piece.name, piece.stored_shape,
                       "config.json implies" if piece.chunks == 1 else
                       f"{piece.chunks} chunks of [q | k | v] rows (num_key_value_heads) make")
    fp8 = reader.is_fp8(piece.name)
    if not fp8:
        scheme = reader.fp8
        if scheme is not None and reader.scale_name(piece.name) in reader:
            raise CheckpointError(f"tensor '{reader.scale_name(piece.name)}' scales '{piece.name}', which is "
                                  f"{reader.dtype(piece.name)}, not FP8")
    elif reader.fp8 is not None and reader.fp8.lists_unconverted(piece.module):
        raise CheckpointError(f"tensor '{piece.name}' is FP8, but quantization_config lists '{piece.module}' as "
                              "not quantized")
    return fp8


def _read(reader: CheckpointReader, pieces: tuple[Piece, ...]) -> Matrix:
    """A model matrix from its pieces: FP8 (values exact, scales gathered) when
    every piece is, else float32 (or the stored float dtype)."""
    fp8 = [_checked_fp8(reader, piece) for piece in pieces]
    # One scale table per distinct source, read once (the chunks of a fused projection share theirs).
    tables: dict[tuple[str, int | None], tuple[torch.Tensor, int]] = {}
    parts: list[Matrix] = []
    for piece, is_fp8 in zip(pieces, fp8):
        whole = piece.rows == range(piece.shape[0]) and piece.expert is None
        values = reader.get(piece.name) if whole else reader.get_rows(piece.name, piece.rows, piece.expert)
        if not is_fp8:
            parts.append(Matrix(values))
            continue
        key = (piece.name, piece.expert)
        if key not in tables:
            tables[key] = reader.read_scale_table(piece.name, *piece.shape, piece.chunks, piece.expert, piece.experts)
        table, group = tables[key]
        parts.append(Matrix(values, table, reader.scale_rows(piece.rows, piece.shape[0], piece.chunks), group))
    if len(parts) == 1:
        return parts[0]
    if not all(fp8) or len({part.group_k for part in parts}) > 1:
        return Matrix(torch.cat([part.dense() for part in parts]))
    # The distinct tables end to end; each piece's rows shifted past the tables before its own.
    first_row = dict(zip(tables, accumulate((t.shape[0] for t, _ in tables.values()), initial=0)))
    rows = [part.scale_row + first_row[(piece.name, piece.expert)] for piece, part in zip(pieces, parts)]
    return Matrix(torch.cat([part.values for part in parts]), torch.cat([t for t, _ in tables.values()]),
                  torch.cat(rows).to(torch.int32), parts[0].group_k)


# ------------------------------------------------------------------- loading
def fp8_resident(quantization: QuantizationMode, scheme: Fp8Scheme | None, device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 in memory (else they are dequantized at load)."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
    if quantization == "none":
        return False
    if quantization == "fp8":
        interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if not (fp8_gemm_supported(device) or interpreted):
            raise ValueError(f"quantization 'fp8' keeps weights FP8 for FP8 GEMMs, which {device} does not run "
                             "(CUDA compute capability 8.9+, or the Triton interpreter with TRITON_INTERPRET=1 on "
                             "CPU); use 'auto' to dequantize FP8 checkpoints at load")
        return True
    return scheme is not None and fp8_gemm_supported(device)


def load_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    ep: ExpertParallel | None = None, quantization: QuantizationMode = "auto",
) -> MiMoV2ForCausalLM:
    """The checkpoint's model; with ``ep``, holding (and reading) only the
    routed experts of ``ep``'s rank."""
    device = torch.device(device)
    model_dir = Path(model_dir)
    with CheckpointReader(model_dir) as reader:
        config = read_config(model_dir, reader)
        layout = CheckpointLayout.read(_read_config_json(model_dir), config)
        resident = fp8_resident(quantization, reader.fp8, device)
        # Built on the meta device: each parameter is allocated once, by its load.
        with meta_build():
            model = MiMoV2ForCausalLM(config)
            if ep is not None:
                for module in model.modules():
                    if isinstance(module, SparseMoE):
                        module.shard(ep)
        owned = ep.experts(config.n_routed_experts) if ep is not None else range(config.n_routed_experts)
        loader = _Loader(reader, config, _Planner(reader, config, layout), device, dtype, resident,
                         online=quantization == "fp8", owned=owned)
        loader.load(model)
        _check_accounted(reader, config, layout)
    if left := [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
        raise RuntimeError(f"the loader left {left[:3]} unloaded")
    return model.eval()


class _Loader:
    def __init__(self, reader: CheckpointReader, config: ModelConfig, planner: _Planner, device: torch.device,
                 dtype: torch.dtype, resident: bool, online: bool, owned: range) -> None:
        self.reader, self.config, self.planner = reader, config, planner
        self.device, self.dtype, self.resident, self.online, self.owned = device, dtype, resident, online, owned

    def load(self, model: MiMoV2ForCausalLM) -> None:
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear):
                self._linear(model, name, module)
            elif isinstance(module, RoutedExperts):
                self._experts(model, name, module)
            else:
                for attr, param in list(module.named_parameters(recurse=False)):
                    self._plain(module, f"{name}.{attr}" if name else attr, attr, tuple(param.shape))
                if isinstance(module, Attention):
                    self._kv_scales(module, name)

    # ---------------------------------------------------------------- pieces
    def _place(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> nn.Parameter:
        loaded = tensor.to(device=self.device, dtype=dtype or tensor.dtype)
        if loaded.data_ptr() % 64:
            loaded = loaded.clone()  # vector kernels (and grouped products) want aligned rows
        return nn.Parameter(loaded, requires_grad=False)

    def _fp8_wanted(self, module_name: str, pieces: tuple[Piece, ...]) -> bool:
        if not self.resident or never_quantized(f"{module_name}.weight"):
            return False
        if _all_fp8(self.reader, pieces):
            return True
        scheme = self.reader.fp8
        listed = scheme is not None and any(scheme.lists_unconverted(piece.module) for piece in pieces)
        return self.online and not listed

    @staticmethod
    def _as_fp8(matrix: Matrix) -> Matrix:
        if matrix.scale is not None:
            return matrix
        values, scale = quantize_blockwise(matrix.values, _ONLINE_BLOCK)
        return Matrix(values, scale, block_scale_rows(values.shape[0], _ONLINE_BLOCK[0]), _ONLINE_BLOCK[1])

    # --------------------------------------------------------------- modules
    def _linear(self, model: nn.Module, name: str, module: nn.Linear) -> None:
        pieces = self.planner.linear(name, module.out_features, module.in_features)
        bias = self.reader.read_dense(f"{name}.bias", (module.out_features,)) if module.bias is not None else None
        if self._fp8_wanted(name, pieces):
            matrix = self._as_fp8(_read(self.reader, pieces))
            assert matrix.scale is not None and matrix.scale_row is not None
            fp8 = Fp8Linear(module.in_features, module.out_features, bias is not None, matrix.scale.shape[0],
                            matrix.group_k)
            fp8.weight = self._place(matrix.values)
            fp8.weight_scale_inv = self._place(matrix.scale)
            fp8.weight_scale_row = matrix.scale_row.to(self.device)
            if bias is not None:
                fp8.bias = self._place(bias, self.dtype)
            _replace(model, name, fp8)
            return
        module.weight = self._place(_read(self.reader, pieces).dense(), self.dtype)
        if bias is not None:
            module.bias = self._place(bias, self.dtype)

    def _experts(self, model: nn.Module, name: str, module: RoutedExperts) -> None:
        hidden, intermediate = module.gate_up_proj.shape[2], module.down_proj.shape[2]
        plans = [self.planner.experts(name, e, hidden, intermediate) for e in self.owned]
        for other in self.planner.other_experts(name, self.owned):
            self.reader.mark_used(other)
        gate_up_pieces, down_pieces = plans[0]
        fp8 = self._fp8_wanted(name, gate_up_pieces + down_pieces)
        if fp8 and not all(_all_fp8(self.reader, gu + d) for gu, d in plans) and not self.online:
            fp8 = False  # some experts float: dequantize all
        local = len(plans)
        if not fp8:
            # The CPU kernel's layout where it runs (filled in place below, so no copy).
            empty = empty_k_major if _cpu_experts_kernel(self.device, self.dtype) else torch.empty
            gate_up = empty(local, 2 * intermediate, hidden, dtype=self.dtype, device=self.device)
            down = empty(local, hidden, intermediate, dtype=self.dtype, device=self.device)
            for i, (gu, d) in enumerate(plans):
                gate_up[i] = _read(self.reader, gu).dense()
                down[i] = _read(self.reader, d).dense()
            module.gate_up_proj, module.down_proj = nn.Parameter(gate_up, False), nn.Parameter(down, False)
            return
        first_gate_up = self._as_fp8(_read(self.reader, gate_up_pieces))
        first_down = self._as_fp8(_read(self.reader, down_pieces))
        assert first_gate_up.scale is not None and first_down.scale is not None
        experts = Fp8RoutedExperts(local, hidden, intermediate, first_gate_up.scale.shape[0],
                                   first_down.scale.shape[0], first_gate_up.group_k)
        tensors = {attr: torch.empty(p.shape, dtype=p.dtype, device=self.device)
                   for attr, p in experts.named_parameters()}
        for i, (gu, d) in enumerate(plans):
            for proj, pieces, first in (("gate_up_proj", gu, first_gate_up), ("down_proj", d, first_down)):
                matrix = first if i == 0 else self._as_fp8(_read(self.reader, pieces))
                if matrix.group_k != experts.group_k or not torch.equal(matrix.scale_row, first.scale_row):
                    raise CheckpointError(f"expert {self.owned[i]} of {name} is quantized unlike expert "
                                          f"{self.owned[0]} ({pieces[0].name})")
                tensors[proj][i] = matrix.values
                tensors[f"{proj}_scale_inv"][i] = matrix.scale
        for attr, tensor in tensors.items():
            setattr(experts, attr, nn.Parameter(tensor, requires_grad=False))
        experts.gate_up_proj_scale_row = first_gate_up.scale_row.to(self.device)  # type: ignore[union-attr]
        experts.down_proj_scale_row = first_down.scale_row.to(self.device)  # type: ignore[union-attr]
        _replace(model, name, experts)

    def _plain(self, owner: nn.Module, name: str, attr: str, shape: tuple[int, ...]) -> None:
        source = name
        if name.endswith("self_attn.sinks") and name not in self.reader:
            source = name.removesuffix("sinks") + "attention_sink_bias"
        dtype = torch.float32 if name.endswith(FLOAT32_SUFFIXES) else self.dtype
        setattr(owner, attr, self._place(self.reader.read_dense(source, shape), dtype))

    def _kv_scales(self, attention: Attention, name: str) -> None:
        """The checkpoint's KV-cache scales for this layer, 1.0 where it has none."""
        for attr, candidates in _KV_SCALE_NAMES.items():
            value = 1.0
            for candidate in (f"{name}.{c}" for c in candidates):
                if candidate in self.reader:
                    value = _positive_scalar(self.reader, candidate)
                    break
            setattr(attention, attr, torch.tensor(value, dtype=torch.float32, device=self.device))
        if f"{name}.kv_scale" in self.reader:  # beside k_scale and v_scale of their own: checked all the same
            _positive_scalar(self.reader, f"{name}.kv_scale")


def describe_weights(model: nn.Module, model_dir: str | Path, quantization: QuantizationMode) -> dict[str, Any]:
    """What ``/stats`` says of the weights: the checkpoint's format, how they are
    held, and the bytes they take where they live."""
    scheme = read_fp8_scheme(_read_config_json(Path(model_dir)))
    fp8_modules = sum(isinstance(m, (Fp8Linear, Fp8RoutedExperts)) for m in model.modules())
    return {"checkpoint": scheme.describe() if scheme is not None else "float",
            "quantization": quantization,
            "fp8_modules": fp8_modules,
            "held_as": "fp8" if fp8_modules else str(model.model.embed_tokens.weight.dtype).removeprefix("torch."),
            "resident_bytes": resident_weight_bytes(model)}


def _positive_scalar(reader: CheckpointReader, name: str) -> float:
    value = reader.get(name)
    if value.numel() != 1 or not value.is_floating_point():
        raise CheckpointError(f"tensor '{name}' should be one float scale, has shape {list(value.shape)} "
                              f"({value.dtype})")
    scale = float(value.to(torch.float32).reshape(()))
    if not scale > 0 or scale == float("inf"):
        raise CheckpointError(f"tensor '{name}' is {scale}: a scale must be positive and finite")
    return scale


def _cpu_experts_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.float32:
        return False
    from llm_core.kv import cpu_kernels
    return cpu_kernels.available()


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    owner_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner_name) if owner_name else model, attr, module)


def _check_accounted(reader: CheckpointReader, config: ModelConfig, layout: CheckpointLayout) -> None:
    """Every tensor was read, or is a documented extra (module docstring)."""
    for name in reader.unused():
        if name.endswith(".input_scale") and reader.fp8 is not None:
            _positive_scalar(reader, name)  # read, so accounted for
    unused = [name for name in reader.unused() if not _known_extra(name, config, layout)]
    extra_mtp = sorted({int(n.split(".")[3]) for n in reader.unused() if _beyond_mtp_depth(n, config)})
    if extra_mtp:
        log.info("checkpoint %s has MTP layers %s past num_nextn_predict_layers=%d: not loaded", reader.model_dir,
                 extra_mtp, config.num_mtp_layers)
    if unused:
        hint = "" if layout.has_towers else "; a multimodal checkpoint declares its towers (vision_config/audio_config)"
        raise CheckpointError(f"checkpoint {reader.model_dir} holds {len(unused)} tensor(s) the model does not use, "
                              f"first '{unused[0]}' (e.g. {unused[:3]}){hint}")


def _beyond_mtp_depth(name: str, config: ModelConfig) -> bool:
    parts = name.split(".")
    return name.startswith("model.mtp.layers.") and parts[3].isdigit() and int(parts[3]) >= config.num_mtp_layers


def _known_extra(name: str, config: ModelConfig, layout: CheckpointLayout) -> bool:
    if _KNOWN_EXTRAS.search(name) or _beyond_mtp_depth(name, config):
        return True
    return layout.has_towers and not _LLM_NAMES.match(name)


def save_model(model: nn.Module, model_dir: str | Path, max_shard_bytes: int = 1 << 30) -> None:
    """Write a model's parameters as (sharded) safetensors plus an index."""
    save_tensors(model.state_dict(), model_dir, max_shard_bytes)


def save_tensors(tensors: dict[str, torch.Tensor], model_dir: str | Path, max_shard_bytes: int = 1 << 30) -> None:
    """Write named tensors as (sharded) safetensors plus an index."""
    from safetensors.torch import save_file

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
             "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


__all__ = ["FLOAT32_SUFFIXES", "QUANTIZATION_MODES", "CheckpointError", "CheckpointReader", "ConfigError", "INDEX_FILE", "SINGLE_FILE",
           "describe_weights", "fp8_resident", "load_model", "read_config", "save_model", "save_tensors"]
