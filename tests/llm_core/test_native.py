"""A built extension is loaded from its stamp only while the stamp is of the
very file there and of the sources, flags and torch it was built from."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_core import native
from llm_core.kv import cpu_kernels


def test_a_stamp_holds_only_for_the_file_it_was_written_for(tmp_path: Path) -> None:
    library = tmp_path / "ext.so"
    library.write_bytes(b"\x7fELF one")
    assert native._stamp_of(library) is None  # never stamped
    native._write_stamp(library, "recipe-a")
    assert native._stamp_of(library) == "recipe-a"
    library.write_bytes(b"\x7fELF another build")  # rebuilt by other code into the same directory
    assert native._stamp_of(library) is None


def test_the_recipe_follows_the_flags() -> None:
    sources = ("kv_page_copy.cpp",)
    assert native._recipe(sources, ("-O3",), ()) == native._recipe(sources, ("-O3",), ())
    assert native._recipe(sources, ("-O3",), ()) != native._recipe(sources, ("-O2",), ())
    assert native._recipe(sources, ("-O3",), ()) != native._recipe(("routed_experts.cpp",), ("-O3",), ())


def test_a_stamped_build_loads_without_torchs_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_kernels.available()  # built (and stamped) here or by `make install`
    from torch.utils import cpp_extension

    def no_build(**_: object) -> None:
        raise AssertionError("a stamped build was checked again by torch")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    path = native.build("swallow_cpu_kernels", cpu_kernels._SOURCES, "CPU kernels", ops_library=True)
    assert isinstance(path, str) and Path(path).exists()


def test_a_stamped_file_that_does_not_load_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils import cpp_extension

    name, sources, flags = "swallow_damaged", ("kv_page_copy.cpp",), ("-O3",)
    library = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
    library.write_bytes(b"not a shared library")
    native._write_stamp(library, native._recipe(sources, flags, ()))
    rebuilt: list[str] = []

    def build_again(**kwargs: object) -> str:
        rebuilt.append(str(kwargs["name"]))
        return "rebuilt"

    monkeypatch.setattr(cpp_extension, "load", build_again)
    assert native.build(name, sources, "damaged", ops_library=True, cflags=flags, ldflags=()) == "rebuilt"
    assert rebuilt == [name]
