"""Building a module before its weights are read: on the meta device, with no
random init.

``torch.device("meta")`` alone still runs every module's ``reset_parameters``,
and on meta tensors ``nn.init``'s initialisers dispatch to torch's Python
reference implementations, whose first use in a process costs 1-2 s of CPU
(their import) for values the loader overwrites anyway. Every process that
loads a model (an engine core, a worker, an encoder, an expert-parallel rank)
paid that at start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["materialize", "meta_build"]


class _SkipInit(TorchFunctionMode):
    """``torch.nn.init``'s in-place initialisers return their tensor untouched
    (a meta tensor has no values to set); every other call goes on."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_"):
            tensor = args[0] if args else kwargs["tensor"]
            if not tensor.is_meta:
                raise RuntimeError(f"meta_build skips {func.__name__} only on meta tensors, got one on {tensor.device}")
            return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_build() -> Iterator[None]:
    """Modules built inside hold meta tensors (shapes, dtypes, no memory) and
    skip their random init; the loader then gives every parameter its values.
    The modes are thread-local: another thread's modules are built as usual."""
    with torch.device("meta"), _SkipInit():
        yield


def materialize(module: nn.Module, device: str | torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """``module.to_empty(device=device).to(dtype)``: its tensors allocated on
    ``device``, uninitialised (floating ones in ``dtype``), for a loader to fill.
    ``to_empty`` makes them with ``empty_like`` of a meta tensor, which is
    torch's Python reference again (sympy's import on first use)."""

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        kind = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=kind, device=device)

    # _apply is what to_empty and to run: modules that recompute buffers on a move see it.
    return module._apply(empty)
