"""Reading a checkpoint directory's safetensors files, one tensor at a time.

Tensors are read with ``pread`` into memory the caller keeps, never mapped:
file pages then sit in the page cache, which the OS reclaims, rather than in
this process's resident set, so loading holds the model plus the tensor in
flight, not the model plus every file it has touched. The reader records
which tensors were read (``used``): the loader turns a tensor nobody read
into an error, so nothing in a checkpoint is dropped without a word.

An FP8 matrix's scales are checked against the config's scheme and read as
the scale table ``fp8.py`` describes (``read_scale_table``, ``scale_rows``);
``read_dense`` gives any tensor as stored, an FP8 matrix as float32 values.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llm_core.loading.errors import CheckpointError
from llm_core.model.config import ConfigError
from llm_core.model.fp8 import DEFAULT_GROUP, FP8_DTYPE, Fp8Scheme, dequantize, read_fp8_scheme

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_HEADER_LIMIT = 100 << 20  # the safetensors format's own bound on a header


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte in the file
    nbytes: int


class _SafetensorsFile:
    """One file's header, and reads of its tensors' bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CheckpointError(f"missing file {path}") from None
        try:
            self.entries = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a readable safetensors file: {why}")

    def _read_header(self) -> dict[str, _Entry]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad("shorter than its 8-byte header length")
        length = int.from_bytes(head, "little")
        if not 0 < length <= min(_HEADER_LIMIT, size - 8):
            raise self._bad(f"header length {length} does not fit the file's {size} bytes")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._bad(f"its header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not an object")
        base, entries = 8 + length, {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(n) for n in info["shape"])
                begin, end = (int(v) for v in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor '{name}' has no valid dtype, shape and data_offsets: {info!r}") from None
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            if end - begin != nbytes or begin < 0 or base + end > size:
                raise self._bad(f"tensor '{name}' ({info['dtype']} {list(shape)}) has bytes [{begin}, {end}) "
                                f"of a {size - base}-byte data section; it needs {nbytes}")
            entries[name] = _Entry(dtype, shape, base + begin, nbytes)
        return entries

    def read(self, entry: _Entry, first_byte: int, shape: tuple[int, ...]) -> torch.Tensor:
        """``shape`` elements of the entry's dtype from ``first_byte`` of its data."""
        out = torch.empty(shape, dtype=entry.dtype)
        if out.numel():
            buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
            got = os.preadv(self._fd, [buffer], entry.offset + first_byte)
            if got != len(buffer):
                raise CheckpointError(f"{self.path} ended while reading a tensor (got {got} of {len(buffer)} bytes)")
        return out

    def close(self) -> None:
        os.close(self._fd)


class CheckpointReader:
    """Name → tensor access over the safetensors files of one directory, with
    the FP8 scheme of its ``config.json`` (if any) and a record of what was read."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.fp8 = _read_scheme(self.model_dir)
        self._files: dict[str, _SafetensorsFile] = {}
        self.used: set[str] = set()
        try:
            self._weight_map = self._read_weight_map()
        except BaseException:
            self.close()
            raise

    def _open(self, file: str) -> _SafetensorsFile:
        if file not in self._files:
            self._files[file] = _SafetensorsFile(self.model_dir / file)
        return self._files[file]

    def _read_weight_map(self) -> dict[str, str]:
        index = self.model_dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{index} has no valid 'weight_map': {exc}") from exc
            for file in sorted(set(weight_map.values())):
                if not (self.model_dir / file).exists():
                    missing = next(name for name, f in weight_map.items() if f == file)
                    raise CheckpointError(f"tensor {missing} is indexed in missing file {self.model_dir / file}")
                unindexed = [name for name in self._open(file).entries if weight_map.get(name) != file]
                if unindexed:
                    raise CheckpointError(f"{self.model_dir / file} holds tensor '{unindexed[0]}' that {index.name} "
                                          f"does not list there ({len(unindexed)} such): the index and the files disagree")
            return weight_map
        files = [SINGLE_FILE] if (self.model_dir / SINGLE_FILE).exists() else []
        files = files or sorted(path.name for path in self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors weights in {self.model_dir}")
        weight_map: dict[str, str] = {}
        for file in files:
            for name in self._open(file).entries:
                if name in weight_map:
                    raise CheckpointError(f"tensor '{name}' is in both {weight_map[name]} and {file}")
                weight_map[name] = file
        return weight_map

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- raw access
    def names(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def _entry(self, name: str) -> tuple[_SafetensorsFile, _Entry]:
        if name not in self._weight_map:
            raise CheckpointError(f"checkpoint {self.model_dir} is missing tensor '{name}' that its config.json "
                                  "requires")
        handle = self._open(self._weight_map[name])
        if name not in handle.entries:
            raise CheckpointError(f"tensor '{name}' is indexed in {handle.path.name}, which does not hold it")
        return handle, handle.entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[1].dtype

    def get(self, name: str) -> torch.Tensor:
        handle, entry = self._entry(name)
        self.used.add(name)
        return handle.read(entry, 0, entry.shape)

    def get_rows(self, name: str, rows: range, expert: int | None = None) -> torch.Tensor:
        """``name[rows]`` (``name[expert][rows]`` of a stacked tensor), reading only those bytes."""
        handle, entry = self._entry(name)
        shape = entry.shape if expert is None else entry.shape[1:]
        row_bytes = torch.Size(shape[1:]).numel() * torch.empty((), dtype=entry.dtype).element_size()
        first = (0 if expert is None else expert * shape[0] * row_bytes) + rows.start * row_bytes
        self.used.add(name)
        return handle.read(entry, first, (len(rows), *shape[1:]))

    def mark_used(self, name: str) -> None:
        """Count ``name`` as accounted for without reading it (another rank's expert)."""
        self._entry(name)
        self.used.add(name)

    def unused(self) -> list[str]:
        return [name for name in self._weight_map if name not in self.used]

    def mtp_layer_count(self) -> int:
        ids = {int(name.split(".")[3]) for name in self._weight_map
               if name.startswith("model.mtp.layers.") and name.split(".")[3].isdigit()}
        return max(ids) + 1 if ids else 0

    # ------------------------------------------------------------ FP8 access
    def check_shape(self, name: str, shape: tuple[int, ...], what: str = "config.json implies") -> None:
        found = self.shape(name)
        if found != tuple(shape):
            raise CheckpointError(f"tensor '{name}' in {self.model_dir} has shape {list(found)}, but {what} "
                                  f"{list(shape)}")

    def is_fp8(self, name: str) -> bool:
        """Whether ``name`` is stored as FP8, which the config must then declare."""
        dtype = self.dtype(name)
        if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return False
        if self.fp8 is None:
            raise CheckpointError(f"tensor '{name}' is {dtype}, but {CONFIG_FILE} has no quantization_config "
                                  "saying how it is scaled")
        if dtype != FP8_DTYPE:
            raise CheckpointError(f"tensor '{name}' is {dtype}, but quantization_config says fmt 'e4m3' "
                                  "(float8_e4m3fn)")
        return True

    def scale_name(self, name: str) -> str:
        """The scale tensor of FP8 weight ``name`` (``X.weight`` -> ``X.weight_scale_inv``;
        a stacked experts tensor ``X.gate_up_proj`` -> ``X.gate_up_proj_scale_inv``)."""
        assert self.fp8 is not None
        return name.removesuffix(".weight") + "." + self.fp8.scale_suffix if name.endswith(".weight") \
            else f"{name}_{self.fp8.scale_suffix.removeprefix('weight_')}"

    def read_scale_table(self, name: str, rows: int, cols: int, chunks: int = 1, expert: int | None = None,
                         experts: int | None = None) -> tuple[torch.Tensor, int]:
        """(float32 scale table [S, ceil(cols / group_k)], group_k) of FP8 matrix
        ``name`` of ``rows`` x ``cols`` (per expert, when stacked), quantized as
        ``chunks`` equal row chunks: its scale tensor checked against what the
        scheme implies, by name and shape."""
        scheme = self.fp8
        assert scheme is not None
        scale = self.scale_name(name)
        if scale not in self:
            raise CheckpointError(f"FP8 tensor '{name}' has no scale: '{scale}' is missing "
                                  f"({scheme.describe()})")
        lead = () if experts is None else (experts,)
        if scheme.block is None:
            allowed = {(), (1,)} | ({(experts,), (experts, 1)} if experts else set())
            if self.shape(scale) not in allowed:
                raise CheckpointError(f"tensor '{scale}' has shape {list(self.shape(scale))}, but a per-tensor "
                                      f"FP8 scale is one value{' (or one per expert)' if experts else ''}")
            values = self.get(scale).to(torch.float32).reshape(-1)
            value = values[0 if expert is None else expert] if values.numel() > 1 else values[0]
            table = value.expand(1, -(-cols // DEFAULT_GROUP)).clone()
            group = DEFAULT_GROUP
        else:
            per_chunk = rows // chunks
            expected = (*lead, chunks * -(-per_chunk // scheme.block[0]), -(-cols // scheme.block[1]))
            self.check_shape(scale, expected, f"its FP8 weight '{name}' ({scheme.describe()}"
                             f"{f', in {chunks} chunks' if chunks > 1 else ''}) needs")
            table = (self.get(scale) if expert is None else self.get_rows(scale, range(expected[1]), expert))
            table = table.to(torch.float32)
            group = scheme.block[1]
        if not torch.isfinite(table).all():
            raise CheckpointError(f"tensor '{scale}' holds a non-finite scale")
        return table.contiguous(), group

    def scale_rows(self, rows: range, total_rows: int, chunks: int = 1) -> torch.Tensor:
        """Scale-table row of each of ``rows`` of a matrix of ``total_rows``
        quantized as ``chunks`` equal row chunks (per tensor: row 0)."""
        assert self.fp8 is not None
        index = torch.arange(rows.start, rows.stop)
        if self.fp8.block is None:
            return torch.zeros(len(rows), dtype=torch.int32)
        per_chunk = total_rows // chunks
        blocks_per_chunk = -(-per_chunk // self.fp8.block[0])
        return (index // per_chunk * blocks_per_chunk + index % per_chunk // self.fp8.block[0]).to(torch.int32)

    def read_dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor ``name`` of ``shape`` as stored, or, for an FP8 matrix, its
        float32 values (scaled by its checked scales)."""
        self.check_shape(name, shape)
        if not self.is_fp8(name):
            return self.get(name)
        if len(shape) != 2:
            raise CheckpointError(f"tensor '{name}' is FP8 but has shape {list(shape)}: only matrices are "
                                  "quantized")
        table, group = self.read_scale_table(name, *shape)
        return dequantize(self.get(name), table, self.scale_rows(range(shape[0]), shape[0]), group)


def _read_scheme(model_dir: Path) -> Fp8Scheme | None:
    path = model_dir / CONFIG_FILE
    if not path.exists():
        return None
    try:
        data: Any = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # the config reader names this error
    if not isinstance(data, dict):
        return None
    try:
        return read_fp8_scheme(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


__all__ = ["CONFIG_FILE", "INDEX_FILE", "SINGLE_FILE", "CheckpointError", "CheckpointReader"]
