"""Fixtures of the core tests: the compiled blake3 chain module, installed or built here,
and a build of it whose memo tags collide."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
from setuptools import Extension

from kvatlas.core import keys
from support.extensions import blake3_build, build_extension

C_SOURCE = Path(keys.__file__).with_name("_chain.c")


@pytest.fixture(scope="session")
def compiled_module(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """`kvatlas.core._chain` as installed, or built here from the BLAKE3 C library as
    setup.py builds it (the vendored one, or ``KVATLAS_BLAKE3_C``'s)."""
    if "compiled" in keys.CHAINS:
        return importlib.import_module("kvatlas.core._chain")
    return _build_chain(tmp_path_factory.mktemp("chain"))


@pytest.fixture(scope="session")
def colliding_module(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The same sources built with tags of no bits (``MEMO_TAG_MASK`` 0): every link of a
    memo set has the same tag, so only the memo's byte comparison tells them apart."""
    return _build_chain(tmp_path_factory.mktemp("chain-colliding"), [("MEMO_TAG_MASK", "0")])


def _build_chain(out: Path, extra: list[tuple[str, str | None]] | None = None) -> ModuleType:
    b3 = blake3_build()
    c_dir = b3.library_dir()
    assert not b3.missing(c_dir), f"the BLAKE3 C library is incomplete: {b3.missing(c_dir)}"
    sources = [str(C_SOURCE), *(str(f) for f in b3.library_sources(c_dir))]
    macros = [*(extra or []), *b3.macros()]
    ext = Extension("_chain", sources, include_dirs=[str(c_dir)], define_macros=macros)
    return build_extension(ext, out)
