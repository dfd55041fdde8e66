"""A package's public names, imported on first use (PEP 562): a process that
needs only a package's light parts never imports what its heavy parts do
(torch, seconds of every start)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, namespace: dict[str, Any], exports: Mapping[str, str]) -> Callable[[str], object]:
    """The ``__getattr__`` of ``package``: name -> the module ``exports`` gives
    for it, imported then, and the value kept in ``namespace`` (the package's
    globals) so the next lookup is a plain one."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
