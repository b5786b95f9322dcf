"""The optional C extensions built in a test's own folder, as ``pip install`` builds them.

Owns ``build_extension``: setuptools' ``build_ext`` of one ``Extension`` (its sources may
include assembler ``.S`` files) into a given folder, and the module loaded from what it
built, under the extension's name, without touching ``sys.modules`` or the installed
package. Must not: decide the sources or flags (each suite knows its extension's), or
skip a test (a suite skips when it has nothing to build from).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import Distribution, Extension
from setuptools.command.build_ext import build_ext


class _BuildExt(build_ext):
    """``build_ext`` that also compiles ``.S`` sources (BLAKE3's assembler)."""

    def build_extensions(self) -> None:
        self.compiler.src_extensions.append(".S")
        super().build_extensions()


def build_extension(ext: Extension, out: Path) -> ModuleType:
    """Build ``ext`` into ``out`` (its temporary files in ``out/tmp``) and load it."""
    dist = Distribution({"ext_modules": [ext], "cmdclass": {"build_ext": _BuildExt}})
    build = dist.get_command_obj("build_ext")
    build.build_lib, build.build_temp = str(out), str(out / "tmp")  # type: ignore[attr-defined]
    build.ensure_finalized()
    build.run()
    (path,) = out.glob(f"{ext.name}*.so")
    spec = importlib.util.spec_from_file_location(ext.name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
