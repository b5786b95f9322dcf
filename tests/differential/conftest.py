"""Fixtures of the differential suite: one LMCache coordinator and one kvatlas
coordinator per test module and LMCache version (`VERSIONS`: 0.5.6 from .venv-lmcache,
0.5.7rc2 from .venv-lmcache057, each built on first use by its script), both with their
defaults, reused across hypothesis examples (each example uses fresh instance ids,
models and salts), and one LMCache MP server (0.5.6) with an engine for the calls both
coordinators forward to a server. The chunk-size tests (``test_chunk_size.py``) start
fresh pairs of their own: a binding lasts as long as the coordinator."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache.conftest import ROOT, lmcache_venv
from lmcache.fleet import KvatlasCoordinator

from .harness import LMCacheCoord, Pair, Target

__all__ = ["lmcache_venv"]

VERSIONS = ("0.5.6", "0.5.7rc2")
"""The LMCache releases whose coordinator the suite compares kvatlas' with."""


@pytest.fixture(scope="session")
def lmcache057_venv() -> Path:
    """.venv-lmcache057 (LMCache 0.5.7rc2), built by scripts/lmcache057_env.sh."""
    venv = Path(os.environ.get("KVATLAS_LMCACHE057_VENV", ROOT / ".venv-lmcache057"))
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "lmcache057_env.sh")],
        check=True,
        env={**os.environ, "KVATLAS_LMCACHE057_VENV": str(venv)},
    )
    return venv


@pytest.fixture(scope="module", params=VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    """The LMCache version a module's pair compares with (each module runs per version)."""
    return str(request.param)


@pytest.fixture(scope="module")
def coordinator_venv(version: str, request: pytest.FixtureRequest) -> Path:
    """The virtual environment of ``version``'s LMCache coordinator."""
    name = "lmcache057_venv" if version == "0.5.7rc2" else "lmcache_venv"
    venv: Path = request.getfixturevalue(name)
    return venv


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("differential")


def start_pair(
    version: str, venv: Path, logs: Path, kv_flags: tuple[str, ...] = (), *lm_flags: str
) -> Pair:
    """A started pair: ``version``'s LMCache coordinator from ``venv`` and kvatlas'."""
    lm = LMCacheCoord(logs, venv, *lm_flags, name=f"lmcache-coord-{version}")
    kv = KvatlasCoordinator(logs, *kv_flags)
    try:
        lm.wait()
        kv.wait()
    except BaseException:
        kv.stop()
        lm.stop()
        raise
    return Pair(lm, kv, version)


@pytest.fixture(scope="module")
def pair(version: str, coordinator_venv: Path, logs: Path) -> Iterator[Pair]:
    p = start_pair(version, coordinator_venv, logs)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def fresh_pair(version: str, coordinator_venv: Path, logs: Path) -> Iterator[Callable[..., Pair]]:
    """Start pairs of their own for one test (``kv_flags``, then LMCache's flags); every
    one is stopped at the end."""
    started: list[Pair] = []

    def start(kv_flags: tuple[str, ...] = (), *lm_flags: str) -> Pair:
        p = start_pair(version, coordinator_venv, logs, kv_flags, *lm_flags)
        started.append(p)
        return p

    try:
        yield start
    finally:
        for p in started:
            p.stop()


@pytest.fixture(scope="session")
def target(lmcache_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    t = Target(tmp_path_factory.mktemp("differential-target"), lmcache_venv)
    try:
        yield t
    finally:
        t.stop()
