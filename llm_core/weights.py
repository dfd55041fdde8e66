"""Lazy safetensors loading (single file or sharded with an index), no pickle.

Checkpoint names are mapped onto the model's parameters one tensor at a time,
so peak memory is the model plus one tensor. The hub spellings are accepted:
``attention_sink_bias`` for sinks and per-expert ``experts.N.{gate,up,down}_proj``
tensors, which are stacked into this model's fused expert tensors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from llm_core.config import ConfigError, ModelConfig
from llm_core.expert_parallel import ExpertParallel
from llm_core.layers import SparseMoE
from llm_core.model import MiMoV2ForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MTP_LAYER = re.compile(r"^model\.mtp\.layers\.(\d+)\.")
# Parameters kept in float32 whatever the model dtype (the router decides ties).
_FLOAT32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
_ROUTED_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match its config."""


class CheckpointReader:
    """Name → tensor access over the safetensors files of one directory."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._weight_map = self._read_weight_map()
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def _read_weight_map(self) -> dict[str, str]:
        index = self.model_dir / INDEX_FILE
        if index.exists():
            try:
                return dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index} has no valid 'weight_map': {exc}") from exc
        files = [self.model_dir / SINGLE_FILE] if (self.model_dir / SINGLE_FILE).exists() else []
        files = files or sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors weights in {self.model_dir}")
        weight_map: dict[str, str] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    weight_map.update({name: file.name for name in handle.keys()})
            except SafetensorError as exc:
                raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
        return weight_map

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def names(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def _handle(self, name: str):  # noqa: ANN202 - safetensors has no public handle type
        file = self._weight_map[name]
        if file not in self._handles:
            path = self.model_dir / file
            if not path.exists():
                raise CheckpointError(f"tensor {name} is indexed in missing file {path}")
            try:
                handle = safe_open(str(path), framework="pt")
            except SafetensorError as exc:
                raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        try:
            return tuple(self._handle(name).get_slice(name).get_shape())
        except SafetensorError as exc:
            raise self._unreadable(name, exc) from exc

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle(name).get_tensor(name)
        except SafetensorError as exc:
            raise self._unreadable(name, exc) from exc

    def get_rows(self, name: str, rows: range) -> torch.Tensor:
        """``name[rows.start:rows.stop]``, reading only those rows from the file."""
        try:
            return self._handle(name).get_slice(name)[rows.start : rows.stop]
        except SafetensorError as exc:
            raise self._unreadable(name, exc) from exc

    def _unreadable(self, name: str, exc: Exception) -> CheckpointError:
        return CheckpointError(
            f"tensor '{name}' is indexed in {self._weight_map[name]} but cannot be read: {exc}"
        )

    def mtp_layer_count(self) -> int:
        ids = {int(m.group(1)) for name in self._weight_map if (m := _MTP_LAYER.match(name))}
        return max(ids) + 1 if ids else 0


def read_config(model_dir: str | Path, reader: CheckpointReader) -> ModelConfig:
    """config.json, with the MTP depth taken from the weights when it does not say."""
    config = ModelConfig.from_json_file(Path(model_dir) / "config.json")
    if config.num_mtp_layers == 0 and (found := reader.mtp_layer_count()):
        config = config.with_mtp_layers(found)
    return config


_ALIGNMENT = 64  # bytes, what torch's CPU allocator gives


def load_model(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    ep: ExpertParallel | None = None,
) -> MiMoV2ForCausalLM:
    """The checkpoint's model; with ``ep``, holding (and reading) only the
    routed experts of ``ep``'s rank."""
    with CheckpointReader(model_dir) as reader:
        config = read_config(model_dir, reader)
        # Built on the meta device: each parameter is allocated once, by its load.
        with torch.device("meta"):
            model = MiMoV2ForCausalLM(config)
            if ep is not None:
                for module in model.modules():
                    if isinstance(module, SparseMoE):
                        module.shard(ep)
        owned = ep.experts(config.n_routed_experts) if ep is not None else range(config.n_routed_experts)
        for name, param in list(model.named_parameters()):
            tensor = _fetch(reader, name, tuple(param.shape), config, owned)
            target_dtype = torch.float32 if name.endswith(_FLOAT32_SUFFIXES) else dtype
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            loaded = tensor.to(device=device, dtype=target_dtype)
            if loaded.data_ptr() % _ALIGNMENT:
                # A view into the file's buffer at the header's offset: vector
                # kernels (and grouped products) want aligned rows.
                loaded = loaded.clone()
            setattr(owner, attr, nn.Parameter(loaded, requires_grad=False))
    return model.eval()


def _fetch(
    reader: CheckpointReader, name: str, shape: tuple[int, ...], config: ModelConfig, experts: range
) -> torch.Tensor:
    """Parameter ``name`` of ``shape``; routed-expert tensors hold ``experts`` only."""
    if name.endswith(_ROUTED_SUFFIXES) and name in reader:
        full = (config.n_routed_experts, *shape[1:])
        if experts == range(full[0]):
            return _checked(reader, name, full)
        _check_shape(reader, name, full)
        return reader.get_rows(name, experts)
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix = name.removesuffix("gate_up_proj")
        per_expert = [
            torch.cat(
                (
                    _checked(reader, f"{prefix}{e}.gate_proj.weight", (shape[1] // 2, shape[2])),
                    _checked(reader, f"{prefix}{e}.up_proj.weight", (shape[1] // 2, shape[2])),
                )
            )
            for e in experts
        ]
        return torch.stack(per_expert)
    if name.endswith("mlp.experts.down_proj"):
        prefix = name.removesuffix("down_proj")
        return torch.stack(
            [_checked(reader, f"{prefix}{e}.down_proj.weight", shape[1:]) for e in experts]
        )
    if name.endswith("self_attn.sinks") and name not in reader:
        return _checked(reader, name.removesuffix("sinks") + "attention_sink_bias", shape)
    if name == "lm_head.weight" and name not in reader and config.tie_word_embeddings:
        return _checked(reader, "model.embed_tokens.weight", shape)
    return _checked(reader, name, shape)


def _checked(reader: CheckpointReader, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    _check_shape(reader, name, shape)
    return reader.get(name)


def _check_shape(reader: CheckpointReader, name: str, shape: tuple[int, ...]) -> None:
    if name not in reader:
        raise CheckpointError(
            f"checkpoint {reader.model_dir} is missing tensor '{name}' that its config.json requires"
        )
    found = reader.shape(name)
    if found != tuple(shape):
        raise CheckpointError(
            f"tensor '{name}' in {reader.model_dir} has shape {list(found)}, "
            f"but config.json implies {list(shape)}"
        )


def save_model(model: nn.Module, model_dir: str | Path, max_shard_bytes: int = 1 << 30) -> None:
    """Write a model's parameters as (sharded) safetensors plus an index."""
    from safetensors.torch import save_file

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in model.state_dict().items():
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


__all__ = ["CheckpointError", "CheckpointReader", "ConfigError", "load_model", "read_config", "save_model"]
