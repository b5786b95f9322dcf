"""Fixtures of the docs' tests: the .venv-lmcache of the LMCache compatibility suite,
and the documented single-machine fleet, shared by every test of this folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from docs.doc_fleet import documented_fleet
from lmcache.conftest import lmcache_venv

__all__ = ["doc_fleet", "lmcache_venv"]


@pytest.fixture(scope="package")
def doc_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """deploy.md's coordinator and node A's server running; documented port -> the
    loopback port it moved to."""
    with documented_fleet(tmp_path_factory.mktemp("doc-fleet")) as ports:
        yield ports
