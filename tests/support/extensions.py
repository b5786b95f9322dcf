"""The optional C extensions built in a test's own folder, as ``pip install`` builds them.

Owns ``build_extension``: setuptools' ``build_ext`` of one ``Extension`` (its sources may
include assembler ``.S`` files) into a given folder, and the module loaded from what it
built, under the extension's name, without touching ``sys.modules`` or the installed
package; and ``blake3_build``, setup.py's description of the BLAKE3 C library's build
(third_party/blake3/build.py), so a suite builds it as setup.py does. Must not: decide
the sources or flags itself, or skip a test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import Distribution, Extension
from setuptools.command.build_ext import build_ext

BLAKE3_BUILD = Path(__file__).resolve().parents[2] / "third_party" / "blake3" / "build.py"


def blake3_build() -> ModuleType:
    """third_party/blake3/build.py, loaded by path as setup.py loads it."""
    return _load("kvatlas_blake3_build", BLAKE3_BUILD)


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _BuildExt(build_ext):
    """``build_ext`` that also compiles ``.S`` sources (BLAKE3's assembler)."""

    def build_extensions(self) -> None:
        self.compiler.src_extensions.append(".S")
        super().build_extensions()


def build_extension(ext: Extension, out: Path) -> ModuleType:
    """Build ``ext`` into ``out`` (its temporary files in ``out/tmp``) and load it."""
    dist = Distribution({"ext_modules": [ext], "cmdclass": {"build_ext": _BuildExt}})
    build = dist.get_command_obj("build_ext")
    build.build_lib, build.build_temp = str(out), str(out / "tmp")
    build.ensure_finalized()
    build.run()
    (path,) = out.glob(f"{ext.name}*.so")
    return _load(ext.name, path)
