"""C++ sources under ``csrc/`` built on first use with ``torch.utils.cpp_extension``
(cached by torch under ``~/.cache/torch_extensions``). A build failure (no
compiler) is logged and answered with None: every caller has a torch path.

torch's loader checks a build in every process (hashes, a ninja run, its
hipify module: over half a second of each engine's start). A build this module
made is stamped with what it was built from, and a later process whose sources,
flags and torch match the stamp, and whose library is the very file stamped,
loads it directly."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
CPU_FLAGS = ("-O3", "-march=native", "-fopenmp")
_STAMP = "swallow-build.json"


def build(name: str, sources: tuple[str, ...], what: str, *, ops_library: bool = False,
          cflags: tuple[str, ...] = CPU_FLAGS, ldflags: tuple[str, ...] = ("-fopenmp",)) -> ModuleType | str | None:
    """The extension built from ``csrc/<source>`` files: a Python module, or with
    ``ops_library`` a library of torch ops (loaded; its path is returned)."""
    recipe = _recipe(sources, cflags, ldflags)
    library = _build_directory(name) / f"{name}.so"
    if _stamp_of(library) == recipe:
        try:
            return _load(name, library, ops_library)
        except (OSError, ImportError) as exc:  # a damaged file: torch's loader builds it again
            log.warning("the stamped C++ %s did not load (%s); building it again", what, exc)
    # Imported only to build: it imports setuptools, 0.6 s of a process's start.
    from torch.utils import cpp_extension

    try:
        library = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
    except Exception as exc:  # noqa: BLE001 - no cache directory: no build either
        log.warning("the C++ %s has no build directory (%s); using the torch path", what, exc)
        return None
    try:
        built = cpp_extension.load(name=name, sources=[str(CSRC / s) for s in sources], extra_cflags=list(cflags),
                                   extra_ldflags=list(ldflags), is_python_module=not ops_library, verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the torch path
        log.warning("the C++ %s did not build (%s); using the torch path", what, exc)
        return None
    # torch names a rebuild within one process name_v1: only the file it loaded is stamped.
    loaded = built if isinstance(built, str) else getattr(built, "__file__", None)
    if loaded is not None and Path(loaded) == library:
        _write_stamp(library, recipe)
    return built


def _build_directory(name: str) -> Path:
    """Where torch's loader builds ``name`` (``cpp_extension``'s rule, read
    without importing it). Were the rule to change, no stamp would be found
    there and the build would go through torch's loader, as a first one does."""
    from torch._appdirs import user_cache_dir

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        flavour = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(user_cache_dir(appname="torch_extensions")),
                            f"{python}_{flavour}")
    return Path(root) / name


def _recipe(sources: tuple[str, ...], cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """What a build is made from: every file of ``csrc/`` (the headers the sources
    include among them), the sources and flags named, torch and Python."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(json.dumps([sources, cflags, ldflags, torch.__version__, sys.version]).encode())
    return digest.hexdigest()


def _stamp_of(library: Path) -> str | None:
    """The recipe stamped beside ``library``, if the stamp is of this very file
    (a build by other code into the same directory replaces it unstamped)."""
    try:
        stamp = json.loads((library.parent / _STAMP).read_text())
        stat = library.stat()
    except (OSError, ValueError):
        return None
    same_file = stamp.get("size") == stat.st_size and stamp.get("mtime_ns") == stat.st_mtime_ns
    return stamp.get("recipe") if same_file else None


def _write_stamp(library: Path, recipe: str) -> None:
    stat = library.stat()
    text = json.dumps({"recipe": recipe, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    partial = library.parent / f"{_STAMP}.{os.getpid()}"
    partial.write_text(text)
    partial.replace(library.parent / _STAMP)  # atomic: a reader sees the old stamp or the new one


def _load(name: str, library: Path, ops_library: bool) -> ModuleType | str:
    if ops_library:
        torch.ops.load_library(str(library))
        return str(library)
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None, library
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
