"""The build of kvatlas' optional C extensions; everything else is in pyproject.toml.

Both are optional: where one cannot be built the install goes on without it, and a
Python twin takes its place (slower, same answers; tests hold them to each other).

- `kvatlas.wire._token_digits`, the JSON token parser of `kvatlas.wire.json_tokens`
  (else its numpy parse), needs a C compiler.
- `kvatlas.core._chain`, the blake3 prefix chain of `kvatlas.core.keys` (else its loop
  over the `blake3` package), needs a C compiler and the official BLAKE3 C sources, which
  Debian installs with ``librust-blake3-dev`` (scripts/bootstrap.sh does) under
  /usr/share/cargo/registry/blake3-*/c, or wherever ``KVATLAS_BLAKE3_C`` names.
"""

import os
import platform
import sys
from glob import glob
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BLAKE3_GLOB = "/usr/share/cargo/registry/blake3-*/c"
X86_ASM = ("sse2", "sse41", "avx2", "avx512")
"""The library's assembly for x86-64 (System V), one file per instruction set; its
dispatch picks the best the CPU has at run time."""


def blake3_sources() -> Path | None:
    """The BLAKE3 C library's directory, or None where it is not installed."""
    named = os.environ.get("KVATLAS_BLAKE3_C")
    found = [Path(named)] if named else [Path(p) for p in sorted(glob(BLAKE3_GLOB))]
    for path in reversed(found):  # the newest version Debian has installed
        if (path / "blake3.h").is_file() and (path / "blake3_dispatch.c").is_file():
            return path
    return None


def chain_extension(c_dir: Path) -> Extension:
    """`kvatlas.core._chain`; the library's own files join its sources at build time
    (`BuildExt`): the package's manifest refuses absolute paths."""
    x86_unix = platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32"
    library = [c_dir / f for f in ("blake3.c", "blake3_dispatch.c", "blake3_portable.c")]
    if x86_unix:
        library += [c_dir / f"blake3_{isa}_x86-64_unix.S" for isa in X86_ASM]
        macros = []
    else:  # the portable C only: no intrinsics flags to get right per file
        macros = [(f"BLAKE3_NO_{isa.upper()}", "1") for isa in X86_ASM]
        macros.append(("BLAKE3_USE_NEON", "0"))
    LIBRARY_SOURCES["kvatlas.core._chain"] = [str(f) for f in library]
    return Extension(
        "kvatlas.core._chain",
        ["src/kvatlas/core/_chain.c"],
        include_dirs=[str(c_dir)],
        define_macros=macros,
        optional=True,
    )


LIBRARY_SOURCES: dict[str, list[str]] = {}
"""Sources outside the tree, by extension name, added when it is built."""


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
    )
]
_c_dir = blake3_sources()
if _c_dir is not None:
    extensions.append(chain_extension(_c_dir))

setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
