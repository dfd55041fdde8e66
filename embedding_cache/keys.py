"""Content-addressed cache keys for media embeddings.

A key names "the embedding this encoder produces for this content under these
preprocessing parameters". It is a blake2b-256 digest: users control the
content, so with a fast non-cryptographic hash one user could craft a
collision and have another user's request served a poisoned embedding.

Every field goes into the hash tagged and length-prefixed, so no two different
inputs can encode to the same byte stream (moving a byte from one content part
to the next, or from the kind into the encoder name, changes the key).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["KEY_BYTES", "ContentPart", "file_digest", "key_hex", "media_key"]

KEY_BYTES = 32

# blake2b personalisation (at most 16 bytes): separates these digests from any
# other blake2b use, and the version lets a future encoding change never
# collide with keys already sitting in a cache.
_PERSONALISATION = b"swallow-mkey-v1"

ContentPart: TypeAlias = "bytes | bytearray | memoryview | torch.Tensor"

_LENGTH_BYTES = 8
_FILE_HASH_CHUNK = 1 << 20


def file_digest(source: str | os.PathLike[str] | bytes) -> bytes:
    """The 32-byte digest of a media file's bytes (a path is read in chunks):
    what upload keys are made from. A clip that is both seen and heard is
    hashed once and its digest handed to both lookups."""
    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    if isinstance(source, bytes):
        digest.update(source)
        return digest.digest()
    with open(source, "rb") as f:
        while chunk := f.read(_FILE_HASH_CHUNK):
            digest.update(chunk)
    return digest.digest()


def media_key(
    kind: str,
    content: ContentPart | Sequence[ContentPart],
    params: Mapping[str, Any] | Any,
    encoder: str,
) -> bytes:
    """The 32-byte cache key of ``content`` (one part or a sequence of parts) of media
    ``kind`` (e.g. "image"), preprocessed with ``params`` and embedded by ``encoder``.

    ``params`` is a mapping or a dataclass of JSON-like values; it is canonicalised
    (sorted keys, tuples as lists, floats by their exact repr), so equal parameters
    give equal keys in every process. A single part and a one-part sequence give the
    same key.
    """
    if not isinstance(kind, str) or not isinstance(encoder, str):
        raise TypeError("kind and encoder must be str")
    digest = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSONALISATION)
    _update_field(digest, b"K", kind.encode("utf-8"))
    _update_field(digest, b"E", encoder.encode("utf-8"))
    _update_field(digest, b"P", canonical_params(params))
    parts = _content_parts(content)
    digest.update(b"N" + len(parts).to_bytes(_LENGTH_BYTES, "little"))
    for part in parts:
        _update_part(digest, part)
    return digest.digest()


def key_hex(key: bytes) -> str:
    """The key as 64 lowercase hex characters (for logs and file names)."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a cache key is {KEY_BYTES} bytes, got {key!r:.80}")
    return key.hex()


def canonical_params(params: Mapping[str, Any] | Any) -> bytes:
    """``params`` as canonical JSON bytes: equal parameters, equal bytes, in any process."""
    text = json.dumps(
        _canonical(params), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True
    )
    return text.encode("utf-8")


def _canonical(value: Any) -> Any:
    # bool is an int subclass and float subclasses (np.float64) repr exactly: both
    # are left to json, which writes floats with repr (round-trip exact, -0.0 != 0.0).
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _canonical(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return _canonical_mapping(value)
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    if isinstance(value, np.generic):
        return _canonical(value.item())
    torch_module = sys.modules.get("torch")  # a torch dtype exists only where torch is imported
    if torch_module is not None and isinstance(value, torch_module.dtype):
        return str(value)
    raise TypeError(f"cannot canonicalise a parameter of type {type(value).__name__}")


def _canonical_mapping(mapping: Mapping[Any, Any]) -> dict[str, Any]:
    # json would silently turn 1 into "1", making {1: x} and {"1": x} collide.
    for name in mapping:
        if not isinstance(name, str):
            raise TypeError(f"parameter names must be str, got {type(name).__name__}")
    return {name: _canonical(item) for name, item in mapping.items()}


def _content_parts(content: ContentPart | Sequence[ContentPart]) -> list[ContentPart]:
    # Tensors and bytes are sequences themselves: test for a single part first.
    if isinstance(content, (bytes, bytearray, memoryview)) or _is_tensor(content):
        return [content]
    if isinstance(content, str) or not isinstance(content, Sequence):
        raise TypeError(f"content must be bytes, a tensor, or a sequence of them, got {type(content).__name__}")
    parts = list(content)
    for part in parts:
        if not (isinstance(part, (bytes, bytearray, memoryview)) or _is_tensor(part)):
            raise TypeError(f"a content part must be bytes or a tensor, got {type(part).__name__}")
    return parts


def _update_part(digest: Any, part: ContentPart) -> None:
    if _is_tensor(part):
        _update_field(digest, b"T", str(part.dtype).encode("ascii"))
        shape = b"".join(int(size).to_bytes(_LENGTH_BYTES, "little") for size in part.shape)
        _update_field(digest, b"S", shape)
        _update_field(digest, b"D", tensor_bytes(part))
    else:
        _update_field(digest, b"B", _byte_view(part))


def _is_tensor(value: object) -> bool:
    # A process that never imported torch holds no tensor: no import needed to tell.
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(value, torch_module.Tensor)


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements as one flat uint8 array (row-major, no copy when already
    a contiguous CPU tensor)."""
    import torch

    flat = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _byte_view(data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    if not isinstance(data, memoryview):
        return data
    # A typed or multi-dimensional view hashes as its raw bytes in C order.
    return data.cast("B") if data.c_contiguous else memoryview(data.tobytes())


def _update_field(digest: Any, tag: bytes, payload: bytes | bytearray | memoryview | np.ndarray) -> None:
    size = payload.nbytes if isinstance(payload, (memoryview, np.ndarray)) else len(payload)
    digest.update(tag + size.to_bytes(_LENGTH_BYTES, "little"))
    digest.update(payload)
