"""Loading encoder weights out of a model checkpoint, and naming an encoder.

A multimodal checkpoint keeps each encoder's tensors under a prefix (``visual.``
in Qwen2.5-VL hub files, ``model.visual.`` when transformers re-saves them,
``audio_tower.``/``model.encoder.`` for Whisper-family towers). The encoder modules
are built with their own parameter names; ``load_submodule`` maps them under
whichever known prefix the checkpoint uses and checks every shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from llm_core.loading.weights import CheckpointError, CheckpointReader

__all__ = ["encoder_identity", "find_prefix", "load_submodule"]


def find_prefix(reader: CheckpointReader, candidates: Sequence[str], probe: str) -> str:
    """The first prefix under which ``probe`` (a tensor name relative to the module) exists."""
    for prefix in candidates:
        if f"{prefix}{probe}" in reader:
            return prefix
    tried = ", ".join(repr(p + probe) for p in candidates)
    raise CheckpointError(f"checkpoint {reader.model_dir} has none of the tensors {tried}")


def load_submodule(module: nn.Module, reader: CheckpointReader, prefix: str) -> None:
    """Copy ``prefix + name`` into every parameter and persistent buffer of ``module``
    (FP8 matrices dequantized by their scales, as the LLM's are).

    A missing tensor, a shape that disagrees with the config, or a tensor under
    the (non-empty) prefix that the module does not use is a ``CheckpointError``
    naming the tensor.
    """
    with torch.no_grad():
        for name, target in module.state_dict().items():
            full = prefix + name
            if full not in reader:
                raise CheckpointError(f"checkpoint {reader.model_dir} is missing tensor '{full}'")
            reader.check_shape(full, tuple(target.shape), "the encoder config implies")
            target.copy_(reader.read_dense(full, tuple(target.shape)).to(target.dtype))
    if prefix:
        unused = [n for n in reader.names() if n.startswith(prefix) and n not in reader.used]
        if unused:
            raise CheckpointError(f"checkpoint {reader.model_dir} holds {len(unused)} tensor(s) under '{prefix}' "
                                  f"that the encoder does not use, first '{unused[0]}'")


def encoder_identity(kind: str, config: Any, module: nn.Module) -> str:
    """A short stable name for *these weights under this config*.

    Embedding-cache keys include it, so two encoders share cached embeddings only
    when their configs and every weight byte agree. Hashing the weights costs one
    pass over them at load time.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(kind.encode())
    h.update(repr(config).encode())
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(str(tensor.dtype).encode())
        h.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"{kind}-{h.hexdigest()}"
