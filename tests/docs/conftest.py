"""Fixtures of the docs' tests: the .venv-lmcache of the LMCache compatibility suite,
and the documented single-machine fleet, shared by every test of this folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from docs.doc_fleet import DocFleet, documented_fleet
from lmcache.conftest import lmcache_venv

__all__ = ["doc_fleet", "lmcache_venv"]


@pytest.fixture(scope="package")
def doc_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocFleet]:
    """deploy.md's coordinator and node A's server, running."""
    with documented_fleet(tmp_path_factory.mktemp("doc-fleet")) as fleet:
        yield fleet
