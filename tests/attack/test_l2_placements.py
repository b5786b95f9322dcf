"""Immortal L2 placements. An L2 STORE from an instance that never
registered (1 TiB claimed) stayed in the directory and its stats after its emitter's
timeout, and L2 placements of an instance gone for good stayed for ever. Replayed against
a real ``kvatlas coordinator``: the never-registered emitter's placements go when it
expires, a departed instance's L2 placements go after ``--l2-retention-s``, and the
metrics count both.

The rules on the fleet state alone (comebacks, zero retention, snapshots of the clocks):
``tests/core/test_l2_retention.py``; against a reference model:
``tests/core/test_fleet_stateful.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from coordinator.events import batch, fake_hash, json_body, register_body
from kvatlas.core.types import Tier
from support.launch import Proc
from support.services import start_coordinator_process
from support.wait import wait_until

from .conftest import client

TIB = 1 << 40
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def coordinator(token_file: Path) -> Iterator[Proc]:
    proc = start_coordinator_process(
        "--auth-token-file", str(token_file), "--instance-timeout", "2",
        "--health-check-interval", "0.5", "--l2-retention-s", "3",
    )  # fmt: skip
    yield proc
    proc.stop()


def _l2(c: httpx.Client) -> tuple[int, int]:
    stats = c.get("/directory/stats").json()
    return stats["placements_by_tier"].get("l2", 0), stats["bytes_by_tier"].get("l2", 0)


def _metric(c: httpx.Client, line: str) -> float:
    for row in c.get("/metrics").text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def test_l2_claims_of_a_never_registered_instance_expire_with_it(coordinator: Proc) -> None:
    with client(coordinator) as c:
        claim = batch("ghost", 1, [fake_hash(1, 7)], tier=Tier.L2, size=TIB - 1)
        r = c.post("/events", content=json_body(claim), headers=JSON)
        assert r.status_code == 200, r.text
        assert _l2(c) == (1, TIB - 1)
        wait_until(
            lambda: _l2(c), lambda l2: l2 == (0, 0),
            what="the ghost's 1 TiB L2 claim to expire with it", timeout=10,
        )  # fmt: skip
        dropped = 'kvatlas_coordinator_fenced_placements_total{reason="expired_unregistered"}'
        assert _metric(c, dropped) == 1.0


def test_l2_of_a_departed_instance_goes_after_the_retention(coordinator: Proc) -> None:
    with client(coordinator) as c:
        assert c.post("/instances", json=register_body("node-a")).status_code == 200
        stored = batch("node-a", 1, [fake_hash(i, 8) for i in range(3)], tier=Tier.L2)
        assert c.post("/events", content=json_body(stored), headers=JSON).status_code == 200
        assert c.delete("/instances/node-a").status_code in (200, 204)
        assert _l2(c)[0] == 3
        assert _metric(c, "kvatlas_coordinator_departed_instances") == 1.0
        # Kept for the retention (3 s) so that a restarted node finds its disk again ...
        wait_until(
            lambda: _l2(c)[0], lambda n: n == 0,
            what="node-a's L2 placements to go after --l2-retention-s", timeout=10,
        )  # fmt: skip
        retention = 'kvatlas_coordinator_fenced_placements_total{reason="l2_retention"}'
        assert _metric(c, retention) == 3.0
        assert _metric(c, "kvatlas_coordinator_departed_instances") == 0.0
