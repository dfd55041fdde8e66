"""media_key: deterministic everywhere, sensitive to every input, injective encoding."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_cache import KEY_BYTES, key_hex, media_key
from embedding_cache.keys import file_digest

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ResizeParams:
    min_pixels: int = 3136
    max_pixels: int = 1_003_520
    mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    modes: dict[str, int] = field(default_factory=lambda: {"b": 2, "a": 1, "c": 3})


IMAGE_BYTES = bytes(range(256)) * 3
PARAMS = {"patch": 14, "merge": 2, "scale": 1 / 255, "interp": "bicubic", "sizes": (224, 448)}


def reference_key() -> bytes:
    return media_key("image", IMAGE_BYTES, PARAMS, "vit-l/14@v1")


def test_key_is_32_bytes_and_hex_round_trips() -> None:
    key = reference_key()
    assert isinstance(key, bytes) and len(key) == KEY_BYTES
    assert key_hex(key) == key.hex() and len(key_hex(key)) == 64
    with pytest.raises(ValueError):
        key_hex(b"short")


def test_same_input_same_key() -> None:
    assert reference_key() == reference_key()
    # Equal params in another insertion order / container type are the same params.
    reordered = dict(reversed(list(PARAMS.items())))
    reordered["sizes"] = [224, 448]
    assert media_key("image", IMAGE_BYTES, reordered, "vit-l/14@v1") == reference_key()
    # bytes, bytearray and memoryview of the same bytes are the same content.
    assert media_key("image", bytearray(IMAGE_BYTES), PARAMS, "vit-l/14@v1") == reference_key()
    assert media_key("image", memoryview(IMAGE_BYTES), PARAMS, "vit-l/14@v1") == reference_key()
    # A single part is a one-part sequence.
    assert media_key("image", [IMAGE_BYTES], PARAMS, "vit-l/14@v1") == reference_key()


def test_dataclass_params_are_their_asdict() -> None:
    params = ResizeParams()
    as_dict = {
        "min_pixels": 3136,
        "max_pixels": 1_003_520,
        "mean": [0.48145466, 0.4578275, 0.40821073],
        "modes": {"a": 1, "b": 2, "c": 3},
    }
    assert media_key("image", b"x", params, "enc") == media_key("image", b"x", as_dict, "enc")
    assert media_key("image", b"x", params, "enc") != media_key("image", b"x", ResizeParams(min_pixels=1), "enc")


@pytest.mark.parametrize(
    "changed",
    [
        {"kind": "video"},
        {"encoder": "vit-l/14@v2"},
        {"content": IMAGE_BYTES[:-1]},
        {"content": IMAGE_BYTES + b"\0"},
        {"content": b"\1" + IMAGE_BYTES[1:]},
        {"params": {**PARAMS, "patch": 16}},
        {"params": {**PARAMS, "scale": math.nextafter(1 / 255, 1.0)}},  # one ulp: floats are repr-exact
        {"params": {**PARAMS, "extra": None}},
        {"params": {**PARAMS, "patch": 14.0}},  # an int and an equal float are different params
        {"params": {**PARAMS, "patch": True}},
        {"params": {k: v for k, v in PARAMS.items() if k != "interp"}},
    ],
)
def test_any_change_changes_the_key(changed: dict) -> None:
    arguments = {"kind": "image", "content": IMAGE_BYTES, "params": PARAMS, "encoder": "vit-l/14@v1", **changed}
    assert media_key(**arguments) != reference_key()


def test_part_boundaries_matter() -> None:
    keys = {
        media_key("video", parts, {}, "enc")
        for parts in ([b"abcd"], [b"ab", b"cd"], [b"a", b"bcd"], [b"abc", b"d"], [b"abcd", b""], [b"", b"abcd"])
    }
    assert len(keys) == 6
    # Moving bytes between adjacent fields must not collide either.
    assert media_key("ab", b"", {}, "c") != media_key("a", b"", {}, "bc")


def test_tensor_content_includes_dtype_and_shape() -> None:
    tensor = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    base = media_key("frames", tensor, {}, "enc")
    assert media_key("frames", tensor.clone(), {}, "enc") == base
    assert media_key("frames", tensor.reshape(4, 3), {}, "enc") != base
    assert media_key("frames", tensor.reshape(12), {}, "enc") != base
    assert media_key("frames", tensor.view(torch.float32), {}, "enc") != base  # same bytes, other dtype
    assert media_key("frames", tensor.numpy().tobytes(), {}, "enc") != base  # the tensor is more than its bytes
    changed = tensor.clone()
    changed[2, 3] += 1
    assert media_key("frames", changed, {}, "enc") != base
    # A non-contiguous tensor hashes by its logical (row-major) contents.
    assert media_key("frames", tensor.t().contiguous().t(), {}, "enc") == base
    # bfloat16 has no numpy dtype but still hashes.
    half = torch.ones(2, 2, dtype=torch.bfloat16)
    assert media_key("frames", half, {}, "enc") != media_key("frames", half.to(torch.float16), {}, "enc")


def test_zero_dim_and_empty_tensors_are_distinct() -> None:
    keys = {
        media_key("audio", t, {}, "enc")
        for t in (torch.tensor(0.0), torch.zeros(1), torch.zeros(0), torch.zeros(0, 1), torch.zeros(1, 1))
    }
    assert len(keys) == 5


def test_mixed_parts() -> None:
    frame = torch.zeros(2, 2, dtype=torch.uint8)
    assert media_key("video", [b"hdr", frame], {}, "enc") != media_key("video", [frame, b"hdr"], {}, "enc")
    assert media_key("video", [b"hdr", frame], {}, "enc") == media_key("video", (b"hdr", frame.clone()), {}, "enc")


def test_rejects_unhashable_inputs() -> None:
    with pytest.raises(TypeError):
        media_key("image", "not bytes", {}, "enc")
    with pytest.raises(TypeError):
        media_key("image", [b"ok", 3], {}, "enc")
    with pytest.raises(TypeError):
        media_key("image", b"x", {1: "int names would collide with '1'"}, "enc")
    with pytest.raises(TypeError):
        media_key("image", b"x", {"opaque": object()}, "enc")


def test_numpy_scalars_and_dtypes_in_params() -> None:
    assert media_key("image", b"x", {"n": np.int64(3)}, "enc") == media_key("image", b"x", {"n": 3}, "enc")
    assert media_key("image", b"x", {"dtype": torch.float16}, "enc") != media_key(
        "image", b"x", {"dtype": torch.bfloat16}, "enc"
    )


_SNIPPET = """
import torch
from embedding_cache import media_key
parts = [bytes(range(256)) * 3, torch.arange(6, dtype=torch.float16).reshape(2, 3)]
params = {"patch": 14, "merge": 2, "scale": 1 / 255, "interp": "bicubic", "sizes": (224, 448),
          "nested": {"z": [1.5, None, True], "a": "x"}}
print(media_key("video", parts, params, "enc").hex())
"""


def test_same_key_across_processes_with_different_hash_seeds() -> None:
    # One other process, whose string hashes differ from this one's: fixed at 0
    # unless this process runs with 0 (unset, it draws a random seed).
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    keys = {out.stdout.strip()}
    local_params = {"nested": {"a": "x", "z": [1.5, None, True]}, "sizes": [224, 448], "interp": "bicubic",
                    "scale": 1 / 255, "merge": 2, "patch": 14}
    local = media_key(
        "video", [bytes(range(256)) * 3, torch.arange(6, dtype=torch.float16).reshape(2, 3)], local_params, "enc"
    )
    assert keys == {local.hex()}


def test_file_digest_is_the_same_for_a_path_and_its_bytes(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)  # several read chunks
    path = tmp_path / "clip.bin"
    path.write_bytes(data)
    assert file_digest(path) == file_digest(str(path)) == file_digest(data)
    assert len(file_digest(data)) == KEY_BYTES and file_digest(data) != file_digest(data[:-1])
