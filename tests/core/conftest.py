"""Fixtures of the core tests: the compiled blake3 chain module, installed or built here,
and a build of it whose memo tags collide."""

from __future__ import annotations

import importlib
import platform
from glob import glob
from pathlib import Path
from types import ModuleType

import pytest
from setuptools import Extension

from kvatlas.core import keys
from support.extensions import build_extension

C_SOURCE = Path(keys.__file__).with_name("_chain.c")
BLAKE3_GLOB = "/usr/share/cargo/registry/blake3-*/c"
X86_ISAS = ("sse2", "sse41", "avx2", "avx512")


@pytest.fixture(scope="session")
def compiled_module(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """`kvatlas.core._chain` as installed, or built here from Debian's BLAKE3 C sources
    (librust-blake3-dev; scripts/bootstrap.sh installs it, so CI always has one)."""
    if "compiled" in keys.CHAINS:
        return importlib.import_module("kvatlas.core._chain")
    return _build_chain(tmp_path_factory.mktemp("chain"))


@pytest.fixture(scope="session")
def colliding_module(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The same sources built with tags of no bits (``MEMO_TAG_MASK`` 0): every link of a
    memo set has the same tag, so only the memo's byte comparison tells them apart."""
    return _build_chain(tmp_path_factory.mktemp("chain-colliding"), [("MEMO_TAG_MASK", "0")])


def _build_chain(out: Path, extra: list[tuple[str, str | None]] | None = None) -> ModuleType:
    found = sorted(glob(BLAKE3_GLOB))
    if not found:
        pytest.skip("no BLAKE3 C sources to build the compiled chain from")
    c_dir = Path(found[-1])
    sources = [str(C_SOURCE)] + [
        str(c_dir / f) for f in ("blake3.c", "blake3_dispatch.c", "blake3_portable.c")
    ]
    macros: list[tuple[str, str | None]] = list(extra or [])
    if platform.machine().lower() in ("x86_64", "amd64"):
        sources += [str(c_dir / f"blake3_{isa}_x86-64_unix.S") for isa in X86_ISAS]
    else:
        macros += [(f"BLAKE3_NO_{isa.upper()}", "1") for isa in X86_ISAS]
        macros.append(("BLAKE3_USE_NEON", "0"))
    ext = Extension("_chain", sources, include_dirs=[str(c_dir)], define_macros=macros)
    return build_extension(ext, out)
