"""C++ sources under ``csrc/`` built on first use with ``torch.utils.cpp_extension``
(cached by torch under ``~/.cache/torch_extensions``). A build failure (no
compiler) is logged and answered with None: every caller has a torch path."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CPU_FLAGS = ("-O3", "-march=native", "-fopenmp")


def build(name: str, sources: tuple[str, ...], what: str, *, ops_library: bool = False,
          cflags: tuple[str, ...] = CPU_FLAGS, ldflags: tuple[str, ...] = ("-fopenmp",)) -> ModuleType | str | None:
    """The extension built from ``csrc/<source>`` files: a Python module, or with
    ``ops_library`` a library of torch ops (loaded; its path is returned)."""
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(name=name, sources=[str(CSRC / s) for s in sources], extra_cflags=list(cflags),
                                  extra_ldflags=list(ldflags), is_python_module=not ops_library, verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the torch path
        log.warning("the C++ %s did not build (%s); using the torch path", what, exc)
        return None
