"""Fixtures of the coordinator tests: a real coordinator served from a thread of the test
process, with an httpx client to talk to it (``start_coordinator`` and ``kafka_broker``
come from ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from support.coordinator import RunningCoordinator


@pytest.fixture
def coord(start_coordinator: Callable[..., RunningCoordinator]) -> RunningCoordinator:
    return start_coordinator()
