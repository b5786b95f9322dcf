"""The build of kvatlas' optional C extensions; everything else is in pyproject.toml.

Both are optional: where one cannot be built the install goes on without it, and a
Python twin takes its place (slower, same answers; tests hold them to each other).

- `kvatlas.wire._token_digits`, the JSON token parser of `kvatlas.wire.json_tokens`
  (else its numpy parse), needs a C compiler.
- `kvatlas.core._blocks`, the device tier's block table and XXH3 token hashes of
  `kvatlas.core.coordinator.block_table` (else its twin over dicts and the `xxhash` package), needs a
  C compiler and xxHash's header, vendored in third_party/xxhash.
- `kvatlas.core._chain`, the blake3 prefix chain of `kvatlas.core.keys` (else its loop
  over the `blake3` package), needs a C compiler and the official BLAKE3 C library,
  vendored in third_party/blake3 (or wherever ``KVATLAS_BLAKE3_C`` names); which of its
  files and macros the build uses is third_party/blake3/build.py's, shared with the tests.
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def blake3_build() -> ModuleType:
    """third_party/blake3/build.py, loaded by path (setup.py runs from any directory)."""
    spec = importlib.util.spec_from_file_location(
        "kvatlas_blake3_build", HERE / "third_party" / "blake3" / "build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chain_extension(b3: ModuleType) -> Extension | None:
    """`kvatlas.core._chain`, or None where the library's files are not all there. The
    library's own files join its sources at build time (`BuildExt`): the package's
    manifest refuses absolute paths (and ``KVATLAS_BLAKE3_C`` may name one)."""
    c_dir = b3.library_dir()
    if b3.missing(c_dir):
        print(
            f"kvatlas: not building kvatlas.core._chain: {b3.missing(c_dir)} missing",
            file=sys.stderr,
        )
        return None
    LIBRARY_SOURCES["kvatlas.core._chain"] = [str(f) for f in b3.library_sources(c_dir)]
    return Extension(
        "kvatlas.core._chain",
        ["src/kvatlas/core/_chain.c"],
        include_dirs=[str(c_dir)],
        define_macros=b3.macros(),
        optional=True,
    )


LIBRARY_SOURCES: dict[str, list[str]] = {}
"""Sources outside the package, by extension name, added when it is built."""


class BuildExt(build_ext):
    """build_ext that adds `LIBRARY_SOURCES` while it compiles (and only then: the
    commands that list the package's files after it refuse them) and also assembles
    ``.S`` files (the C compiler preprocesses them)."""

    def build_extensions(self) -> None:
        if ".S" not in self.compiler.src_extensions:
            self.compiler.src_extensions.append(".S")
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        own = ext.sources
        ext.sources = [*own, *LIBRARY_SOURCES.get(ext.name, [])]
        try:
            super().build_extension(ext)
        finally:
            ext.sources = own


extensions = [
    Extension(
        "kvatlas.wire._token_digits",
        ["src/kvatlas/wire/_token_digits.c"],
        optional=True,
    ),
    Extension(
        "kvatlas.core._blocks",
        ["src/kvatlas/core/_blocks.c"],
        include_dirs=[str(HERE / "third_party" / "xxhash")],
        extra_compile_args=["-O2"],
        optional=True,
    ),
]
_chain = chain_extension(blake3_build())
if _chain is not None:
    extensions.append(_chain)

setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
