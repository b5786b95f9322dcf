"""Instances that register without an incarnation (LMCache's servers): their events carry
the process start time as incarnation, and the registered instance takes it instead of
turning provisional (which would expire and fence a live server) or being refused."""

from __future__ import annotations

import msgspec

from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.coordinator.gate import Verdict
from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier

START = 1_760_000_000
KEYS = [ObjectKey(bytes([i]) * 32, "m", default_kv_rank()) for i in range(4)]


def lmcache(iid: str = "mp-a") -> InstanceInfo:
    return InstanceInfo(InstanceId(iid), "127.0.0.1", 8080, {}, incarnation_from_events=True)


def store(seq: int, incarnation: int, *keys: int, tier: Tier = Tier.L1) -> EventBatch:
    entries = tuple(Entry(KEYS[k], 10) for k in keys)
    return EventBatch(
        InstanceId("mp-a"), Incarnation(incarnation), seq, EventType.STORE, tier, entries
    )


def placed(fleet: FleetState) -> list[int]:
    return [i for i, r in enumerate(fleet.lookup_keys(KEYS)) if r.placements]


def test_the_registered_instance_takes_its_events_incarnation() -> None:
    fleet = FleetState(instance_timeout=5.0)
    outcome, _ = fleet.register(lmcache(), 0.0)
    assert outcome.incarnation == 0
    out = fleet.ingest(store(1, START, 0), 1.0)
    assert (out.verdict, out.provisional) == (Verdict.APPLY, False)
    assert fleet.provisional() == {}
    [live] = fleet.instances()
    assert (live.incarnation, live.incarnation_from_events) == (START, True)
    # it lives by its heartbeats, not by its events
    assert fleet.heartbeat(InstanceId("mp-a"), 4.0)
    assert fleet.expire(8.0) == [] and placed(fleet) == [0]
    # a re-registration (after a 404 on a heartbeat) keeps the incarnation: not stale
    outcome, fenced = fleet.register(lmcache(), 8.5)
    assert (outcome.re_registered, outcome.incarnation, fenced) == (True, START, None)
    assert fleet.ingest(store(2, START, 1), 9.0).verdict is Verdict.APPLY
    assert placed(fleet) == [0, 1]


def test_a_restarted_process_fences_the_old_ones_l1_and_keeps_l2() -> None:
    fleet = FleetState()
    fleet.register(lmcache(), 0.0)
    fleet.ingest(store(1, START, 0), 1.0)
    fleet.ingest(store(2, START, 1, tier=Tier.L2), 1.0)
    fleet.register(lmcache(), 2.0)  # the new process registers first ...
    out = fleet.ingest(store(1, START + 60, 2), 3.0)  # ... then its events arrive
    assert (out.provisional, out.fenced) == (False, 1)
    assert placed(fleet) == [1, 2]
    assert fleet.instances()[0].incarnation == START + 60
    # the old process's late events are stale now
    assert fleet.ingest(store(3, START, 3), 4.0).verdict is Verdict.STALE


def test_events_before_the_registration_and_after_a_deregistration() -> None:
    fleet = FleetState()
    assert fleet.ingest(store(1, START, 0), 1.0).provisional  # Kafka: events came first
    outcome, fenced = fleet.register(lmcache(), 2.0)
    assert (outcome.incarnation, fenced, fleet.provisional()) == (START, None, {})
    assert placed(fleet) == [0]
    fleet.deregister(InstanceId("mp-a"), 0.0)
    outcome, _ = fleet.register(lmcache(), 3.0)  # back: not refused as stale
    assert outcome.incarnation == START


def test_an_instance_with_its_own_incarnation_is_not_moved_by_its_events() -> None:
    fleet = FleetState()
    fleet.register(msgspec.structs.replace(lmcache(), incarnation_from_events=False), 0.0)
    assert fleet.ingest(store(1, START, 0), 1.0).provisional
    assert fleet.instances()[0].incarnation == 0
