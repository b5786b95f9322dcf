"""How `kvatlas.core._chain` is built from the BLAKE3 C library: the one description that
setup.py and the core tests' own build share.

Owns the library's directory (this one, the vendored sources, unless ``KVATLAS_BLAKE3_C``
names another), the library's files the extension compiles with, and the macros it needs
on the machine that builds. Must not: import kvatlas or setuptools (setup.py loads it by
path before either is usable), or compile anything itself.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION = "1.3.1"
"""The upstream BLAKE3 release the vendored files come from (see README.md here)."""
X86_ASM = ("sse2", "sse41", "avx2", "avx512")
"""The library's assembly for x86-64 (System V), one file per instruction set; its
dispatch picks the best the CPU has at run time."""
PORTABLE = ("blake3.c", "blake3_dispatch.c", "blake3_portable.c")


def library_dir() -> Path:
    """Where the library's C files are: ``KVATLAS_BLAKE3_C`` when set, else here."""
    named = os.environ.get("KVATLAS_BLAKE3_C")
    return Path(named) if named else HERE


def _x86_unix() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32"


def library_sources(c_dir: Path) -> list[Path]:
    """The library's files to compile beside the extension's own, for this machine."""
    files = [c_dir / f for f in PORTABLE]
    if _x86_unix():
        files += [c_dir / f"blake3_{isa}_x86-64_unix.S" for isa in X86_ASM]
    return files


def macros() -> list[tuple[str, str | None]]:
    """The library's macros for this machine: none on x86-64 Unix (its assembly and run
    time dispatch); elsewhere the portable C only (no intrinsics flags to get right per
    file)."""
    if _x86_unix():
        return []
    out: list[tuple[str, str | None]] = [(f"BLAKE3_NO_{isa.upper()}", "1") for isa in X86_ASM]
    out.append(("BLAKE3_USE_NEON", "0"))
    return out


def missing(c_dir: Path) -> list[str]:
    """The files of this machine's build that ``c_dir`` lacks (none: it can build)."""
    wanted = [c_dir / "blake3.h", c_dir / "blake3_impl.h", *library_sources(c_dir)]
    return [str(f) for f in wanted if not f.is_file()]
