"""Modules built before their weights are read: on meta, no random init, and
a loading process that never pays for torch's Python reference kernels."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from llm_core.model.meta_build import materialize, meta_build


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.embedding = nn.Embedding(5, 4)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("index", torch.zeros(3, dtype=torch.int32))


def test_modules_are_built_on_meta_without_their_init() -> None:
    with meta_build():
        block = _Block()
    assert all(t.is_meta for t in [*block.parameters(), *block.buffers()])
    assert block.linear.weight.shape == (3, 4) and block.index.dtype == torch.int32


def test_an_initialiser_on_real_memory_inside_is_refused() -> None:
    # Skipping it there would leave uninitialised memory where the code expects values.
    with meta_build(), pytest.raises(RuntimeError, match="only on meta tensors"):
        nn.Linear(4, 3, device="cpu")


def test_another_thread_builds_as_usual() -> None:
    built: list[nn.Linear] = []
    with meta_build():
        worker = threading.Thread(target=lambda: built.append(nn.Linear(4, 3)))
        worker.start()
        worker.join()
    assert built[0].weight.device.type == "cpu" and built[0].weight.abs().sum() > 0


def test_materialize_allocates_and_converts_floating_tensors_only() -> None:
    with meta_build():
        block = _Block()
    materialize(block, "cpu", torch.bfloat16)
    assert all(t.device.type == "cpu" for t in [*block.parameters(), *block.buffers()])
    assert block.linear.weight.dtype == torch.bfloat16 and block.index.dtype == torch.int32
    assert block.linear.weight.shape == (3, 4)


def test_loading_a_model_imports_neither_sympy_nor_setuptools(tiny_checkpoint: Path) -> None:
    # Each of those is a second of every engine's, worker's or encoder's start:
    # sympy through torch's Python reference kernels on meta tensors, setuptools
    # through torch's extension loader when the native kernels are already built.
    script = (
        "import sys\n"
        "from llm_core.llm import LLM\n"
        f"LLM({str(tiny_checkpoint)!r})\n"
        "assert 'sympy' not in sys.modules, 'building the model imported sympy'\n"
        "assert 'setuptools' not in sys.modules, 'loading the native kernels imported setuptools'\n"
    )
    from llm_core.llm import LLM

    LLM(tiny_checkpoint)  # builds the native kernels where none are (`make install` has built them)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
