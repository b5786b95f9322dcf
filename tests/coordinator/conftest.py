"""Fixtures of the coordinator tests: real coordinators (uvicorn on 127.0.0.1, ephemeral
ports) running in threads, and httpx clients to talk to them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kvatlas.coordinator.app import Coordinator
from kvatlas.coordinator.config import CoordinatorConfig

BASE = CoordinatorConfig(host="127.0.0.1", port=0, snapshot_interval=0)


class RunningCoordinator:
    """A coordinator served from a thread of the test process."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.coordinator = Coordinator(config)
        self.port = self.coordinator.bind()
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.coordinator.run, daemon=True)
        self._thread.start()
        headers = {"Authorization": f"Bearer {config.auth_token}"} if config.auth_token else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=30)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("coordinator did not come up")
            time.sleep(0.02)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.client.get("/readyz").status_code != 200:
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready: {self.client.get('/readyz').text}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.client.close()
        self.coordinator.stop()
        self._thread.join(30)
        assert not self._thread.is_alive(), "coordinator did not stop"


@pytest.fixture
def start_coordinator() -> Iterator[Callable[..., RunningCoordinator]]:
    running: list[RunningCoordinator] = []

    def start(**overrides: Any) -> RunningCoordinator:
        rc = RunningCoordinator(replace(BASE, **overrides))
        running.append(rc)
        return rc

    yield start
    for rc in running:
        if rc._thread.is_alive():
            rc.stop()


@pytest.fixture
def coord(start_coordinator: Callable[..., RunningCoordinator]) -> RunningCoordinator:
    return start_coordinator()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[Any]:
    from kafka_broker import KafkaBroker

    broker = KafkaBroker.start()
    yield broker
    broker.stop()
