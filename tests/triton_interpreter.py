"""Importing a Triton-kernel module so that its kernels run where this machine
can: compiled on CUDA, else on CPU tensors under the Triton interpreter."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch


def use_interpreter_without_cuda() -> None:
    """triton reads TRITON_INTERPRET when ``triton.jit`` decorates: set it before
    any kernel module is imported."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def import_kernels(name: str) -> ModuleType:
    """Module ``name``, (re)imported under the current TRITON_INTERPRET setting."""
    use_interpreter_without_cuda()
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in sys.modules:
        # Triton was imported before the variable was set: its own jit'd
        # library functions (tl.max, tl.sum, ...) were compiled-mode objects
        # the interpreter cannot call, so re-decorate them first.
        import triton.language
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton.language.standard.max, InterpretedFunction):
            importlib.reload(triton.language.standard)
            importlib.reload(triton.language)
    module = sys.modules.get(name)
    # Imported earlier, maybe before the variable was set: a reload re-decorates
    # the kernels under the current setting.
    return importlib.import_module(name) if module is None else importlib.reload(module)
