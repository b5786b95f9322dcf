"""Fixtures of the coordinator tests: a real coordinator served from a thread of the test
process, with an httpx client to talk to it (``start_coordinator`` and ``kafka_broker``
come from ``tests/conftest.py``)."""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.coordinator import RunningCoordinator

PM_QOS_LOCK = Path(tempfile.gettempdir()) / "kvatlas-tests-pm-qos.lock"


@pytest.fixture
def coord(start_coordinator: Callable[..., RunningCoordinator]) -> RunningCoordinator:
    return start_coordinator()


@pytest.fixture
def pm_qos_device() -> Iterator[None]:
    """The kernel's PM QoS device to this test alone. The limit it keeps is the lowest
    over every holder on the host, so a test that holds one and reads it back must not
    run beside another such test (``make test-fast`` runs two workers; another run may
    share the host): it holds this file lock for its whole run."""
    with PM_QOS_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
