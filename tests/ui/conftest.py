"""One fleet (a coordinator and servers node-a and node-b, no token) shared by the tests
of this package that only read it or undo what they add: starting one costs seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .fleet import Fleet, fleet


@pytest.fixture(scope="package")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(tmp_path_factory.mktemp("fleet"), "node-a", "node-b") as fl:
        yield fl
