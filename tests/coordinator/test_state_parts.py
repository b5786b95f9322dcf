"""The coordinator service's parts (`kvatlas.coordinator.state`) over one locked fleet:
what one part changes, the others see; the clock and the timer are the injected ones;
the operator's log lines stay on the service's logger."""

from __future__ import annotations

import logging

import msgspec
import pytest

from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.core.coordinator.fleet import FenceReason, FleetState
from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.keys import Namespace
from kvatlas.core.types import ChunkHash, Incarnation, InstanceId, Tier

from .events import MODEL, RANK, batch, fake_hash

TIMEOUT = 30.0


class Ticks:
    """A hand-set clock (wall seconds) and a timer that moves 0.25 s per reading."""

    def __init__(self) -> None:
        self.now = 100.0
        self.timer_at = 0.0

    def clock(self) -> float:
        return self.now

    def timer(self) -> float:
        self.timer_at += 0.25
        return self.timer_at


class _Book(msgspec.Struct):
    keys: int


def _service(ticks: Ticks) -> CoordinatorService:
    return CoordinatorService(
        FleetState(TIMEOUT, 256), CoordinatorMetrics(), clock=ticks.clock, timer=ticks.timer
    )


def _hashes(*ids: int) -> list[ChunkHash]:
    return [ChunkHash(fake_hash(i)) for i in ids]


def _info(iid: str, incarnation: int = 1) -> InstanceInfo:
    return InstanceInfo(
        InstanceId(iid), "127.0.0.1", 8080, {}, incarnation=Incarnation(incarnation)
    )


def test_the_parts_share_one_fleet() -> None:
    ticks = Ticks()
    svc = _service(ticks)
    svc.membership.register(_info("node-a"), ticks.now)
    got = svc.ingest.apply([batch("node-a", 1, [fake_hash(1), fake_hash(2)])], ticks.now)
    assert (got.applied, got.duplicates, got.stale) == (1, 0, 0)

    res = svc.lookups.prefix(_hashes(1, 2, 3), Namespace(MODEL, RANK))
    assert [(h.instance_id, h.tier, h.chunks) for h in res.holders] == [("node-a", Tier.L1, 2)]
    assert [i.instance_id for i in svc.views.instances(ticks.now)] == ["node-a"]
    assert svc.views.stats().live_instances == 1
    assert svc.membership.deregister(InstanceId("node-a"), ticks.now)
    assert svc.views.instances(ticks.now) == []
    assert svc.lookups.prefix(_hashes(1), Namespace(MODEL, RANK)).holders == ()


def test_sample_reads_the_injected_clock() -> None:
    ticks = Ticks()
    svc = _service(ticks)
    svc.membership.register(_info("node-a"), ticks.now)
    ticks.now += 7.5
    assert svc.views.sample().heartbeat_age == {"node-a": 7.5}
    ticks.now += 2.5
    assert svc.views.sample().heartbeat_age == {"node-a": 10.0}


def test_snapshot_times_its_lock_hold_with_the_injected_timer() -> None:
    ticks = Ticks()
    svc = _service(ticks)
    svc.state.positions["kafka:t:0"] = 5
    held: list[bool] = []

    def book() -> _Book:
        held.append(svc.state.lock.locked())
        return _Book(3)

    svc.snapshots.companion = book
    body, extra, locked = svc.snapshots.parts()
    assert locked == 0.25
    assert held == [True]
    assert extra == msgspec.msgpack.encode(_Book(3))
    again, locked_again = svc.snapshots.snapshot()
    assert again == body and locked_again == 0.25


def test_expiry_tells_the_drop_observers_of_an_unregistered_instance() -> None:
    ticks = Ticks()
    svc = _service(ticks)
    dropped: list[str] = []
    svc.expiry.drop_observers.append(dropped.append)
    got = svc.ingest.apply([batch("ghost", 1, [fake_hash(1)])], ticks.now)
    assert got.provisional == 1
    assert svc.expiry.candidates(ticks.now + TIMEOUT + 1) == [
        (InstanceId("ghost"), Incarnation(1), ticks.now)
    ]
    fenced = svc.expiry.expire(ticks.now + TIMEOUT + 1)
    assert [(f.instance_id, f.reason) for f in fenced] == [
        ("ghost", FenceReason.EXPIRED_UNREGISTERED)
    ]
    assert dropped == ["ghost"]


def test_readiness_answers_readyz() -> None:
    svc = _service(Ticks())
    assert svc.readiness.status() == (False, "starting")
    svc.readiness.set_ready()
    assert svc.readiness.status() == (True, "")
    svc.readiness.set_snapshot_failure("last snapshot failed")
    assert svc.readiness.status() == (False, "last snapshot failed")
    assert svc.readiness.ready
    svc.readiness.set_snapshot_failure("")
    svc.readiness.set_not_ready("catching up")
    assert svc.readiness.status() == (False, "catching up")


def test_log_lines_stay_on_the_service_logger(caplog: pytest.LogCaptureFixture) -> None:
    ticks = Ticks()
    svc = _service(ticks)
    with caplog.at_level(logging.INFO, logger="kvatlas.coordinator.service"):
        svc.membership.register(_info("node-a"), ticks.now)
        svc.ingest.apply([batch("node-a", 3, [fake_hash(1)])], ticks.now)
        svc.membership.bind_chunk_size(256)
        assert not svc.membership.heartbeat(InstanceId("nobody"), ticks.now)
    lines = [(r.name, r.getMessage()) for r in caplog.records]
    assert (
        "kvatlas.coordinator.service",
        "Registered instance node-a at 127.0.0.1:8080 (incarnation 1)",
    ) in lines
    assert any(
        name == "kvatlas.coordinator.service" and msg.startswith("Gap of 2 seqs")
        for name, msg in lines
    )
    assert (
        "kvatlas.coordinator.service",
        "Heartbeat from unknown instance nobody; asked to re-register",
    ) in lines
