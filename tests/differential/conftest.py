"""Fixtures of the differential suite: one LMCache coordinator and one kvatlas
coordinator per test module, both with their defaults, reused across hypothesis
examples (each example uses fresh instance ids, models and salts), and one LMCache MP
server with an engine for the calls both coordinators forward to a server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache.conftest import lmcache_venv
from lmcache.fleet import KvatlasCoordinator

from .harness import LMCacheCoord, Pair, Target

__all__ = ["lmcache_venv"]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("differential")


@pytest.fixture(scope="module")
def pair(lmcache_venv: Path, logs: Path) -> Iterator[Pair]:
    lm = LMCacheCoord(logs, lmcache_venv)
    kv = KvatlasCoordinator(logs)
    try:
        lm.wait()
        kv.wait()
        yield Pair(lm, kv)
    finally:
        kv.stop()
        lm.stop()


@pytest.fixture(scope="session")
def target(lmcache_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    t = Target(tmp_path_factory.mktemp("differential-target"), lmcache_venv)
    try:
        yield t
    finally:
        t.stop()
