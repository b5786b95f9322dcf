"""Fixtures and hooks every test suite shares.

pytest imports this file first (the rootdir's conftest: tests/ has no ``__init__.py``) and
puts tests/ on sys.path, so ``support`` and each suite's helpers import by name from any
test, however pytest is started (``make check`` runs ``python -m pytest -q`` at the repo
root). A failed test's report carries the log tails of the processes it launched.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvatlas.launch.broker import Broker
from kvatlas.runtime.region import SHM_DIR
from kvatlas.server.storage.l1_journal import discard_kept, kept_state_dir
from support import launch
from support.coordinator import RunningCoordinator
from support.kafka import start_broker

_FIRST_LAUNCHED = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_FIRST_LAUNCHED] = len(launch.LAUNCHED)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        first = item.stash.get(_FIRST_LAUNCHED, len(launch.LAUNCHED))
        for proc in launch.LAUNCHED[first:]:
            report.sections.append((f"log of {proc.name} (pid {proc.pid})", proc.tail()))


def _drop_kept_l1_regions(base: Path) -> None:
    """Remove the L1 regions that servers of this session kept in /dev/shm for a warm
    restart (``--l1-warm-restart``, on by default): those whose state dir is under the
    session's temp dir ``base`` and that no running process holds."""
    for path in SHM_DIR.glob("kvatlas-*-l1"):
        state = kept_state_dir(path.name)
        if state is not None and state.is_relative_to(base):
            discard_kept(path.name)


@pytest.fixture(autouse=True)
def _kept_l1_regions_per_test(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    _drop_kept_l1_regions(tmp_path_factory.getbasetemp().resolve())


@pytest.fixture(autouse=True, scope="session")
def _kept_l1_regions_per_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the module-scoped servers, which outlive the tests, have stopped."""
    yield
    _drop_kept_l1_regions(tmp_path_factory.getbasetemp().resolve())


@pytest.fixture
def start_coordinator() -> Iterator[Callable[..., RunningCoordinator]]:
    """Start real coordinators in this process (``CoordinatorConfig`` fields as keywords,
    on ``support.coordinator.BASE``); every one still running is stopped at the end."""
    running: list[RunningCoordinator] = []

    def start(**overrides: Any) -> RunningCoordinator:
        rc = RunningCoordinator.start(**overrides)
        running.append(rc)
        return rc

    yield start
    for rc in running:
        if rc.running:
            rc.stop()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[Broker]:
    """One tansu broker for the session (tests create their own topics)."""
    with start_broker() as broker:
        yield broker
