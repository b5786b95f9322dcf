"""The real coordinator served from a thread of the test process, on 127.0.0.1.

Owns ``RunningCoordinator``: ``kvatlas.coordinator.app.Coordinator`` built from a config,
bound (a port of 0 picks a free one), serving in a daemon thread, with an httpx client
that carries the bearer token when one is set; ``stop()`` is the clean shutdown (it writes
the last snapshot when a snapshot path is set), and a new one started with the same port
and snapshot path is a restart. Must not: stand in for the coordinator (no answers of its
own), or reach into its state: tests observe it through its HTTP API.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx

from kvatlas.coordinator.app import Coordinator
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.launch.procs import HOST
from support.wait import wait_until

BASE = CoordinatorConfig(host=HOST, port=0, snapshot_interval=0)
"""What the tests start from: loopback, a free port, snapshots only at clean shutdown."""


class RunningCoordinator:
    """A coordinator served from a thread of the test process."""

    def __init__(self, config: CoordinatorConfig, clock: Callable[[], float] | None = None) -> None:
        """``clock``: the coordinator's wall clock (a test's own, to let time pass
        without sleeping); None: ``time.time``."""
        self.config = config
        self.coordinator = Coordinator(config) if clock is None else Coordinator(config, clock)
        self.port = self.coordinator.bind()
        self.url = f"http://{HOST}:{self.port}"
        self._thread = threading.Thread(target=self.coordinator.run, daemon=True)
        self._thread.start()
        headers = {"Authorization": f"Bearer {config.auth_token}"} if config.auth_token else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=30)
        wait_until(
            lambda: self.client.get("/healthz").status_code,
            lambda status: status == 200,
            what=f"the coordinator on port {self.port} to answer /healthz",
            timeout=10,
            every=0.02,
            ignore=(httpx.TransportError,),
        )

    @classmethod
    def start(
        cls, clock: Callable[[], float] | None = None, **overrides: Any
    ) -> RunningCoordinator:
        """``BASE`` with ``overrides`` (CoordinatorConfig fields), on ``clock``."""
        return cls(replace(BASE, **overrides), clock)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait_ready(self, timeout: float = 30) -> None:
        def readyz() -> tuple[int, str]:
            r = self.client.get("/readyz")
            return r.status_code, r.text

        wait_until(
            readyz,
            lambda seen: seen[0] == 200,
            what="the coordinator to be ready (/readyz 200)",
            timeout=timeout,
        )

    def stats(self, digest: bool = False) -> dict[str, Any]:
        """``GET /directory/stats`` (with the directory digest when asked)."""
        r = self.client.get("/directory/stats", params={"digest": "1"} if digest else {})
        assert r.status_code == 200, r.text
        return dict(r.json())

    def instance_ids(self) -> list[str]:
        """``GET /instances``: the live instances' ids."""
        return [i["instance_id"] for i in self.client.get("/instances").json()["instances"]]

    def stop(self) -> None:
        self.client.close()
        self.coordinator.stop()
        self._thread.join(30)
        assert not self._thread.is_alive(), "coordinator did not stop"
