"""L2 placements do not outlive their instance for ever: an instance
that never registered loses every placement when it expires, and one that is gone
(deregistered or expired) keeps its L2 placements for the retention only, unless it comes
back. Snapshots keep the retention clocks."""

from __future__ import annotations

from kvatlas.core.coordinator.fleet import FenceReason, FleetState
from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier

TIMEOUT = 10.0
RETENTION = 100.0
TIB = 1 << 40


def key(i: int) -> ObjectKey:
    return ObjectKey(bytes([i]) * 32, "m", default_kv_rank())


def store(iid: str, seq: int, tier: Tier, keys: range, size: int = 1024) -> EventBatch:
    entries = tuple(Entry(key(i), size) for i in keys)
    return EventBatch(InstanceId(iid), Incarnation(1), seq, EventType.STORE, tier, entries)


def fleet() -> FleetState:
    return FleetState(instance_timeout=TIMEOUT, l2_retention=RETENTION)


def register(f: FleetState, iid: str, now: float) -> None:
    f.register(
        InstanceInfo(InstanceId(iid), "127.0.0.1", 7000, {}, incarnation=Incarnation(1)), now
    )


def held(f: FleetState, iid: str) -> dict[Tier, int]:
    out: dict[Tier, int] = {}
    for _ns, _prefix, ps in f.directory.canonical():
        for p in ps:
            if p.instance_id == iid:
                out[p.tier] = out.get(p.tier, 0) + 1
    return out


def test_an_instance_that_never_registered_loses_l2_when_it_expires() -> None:
    f = fleet()
    register(f, "honest", 0.0)
    f.ingest(store("honest", 1, Tier.L2, range(3)), 0.0)
    out = f.ingest(store("ghost", 1, Tier.L2, range(3), size=TIB - 1), 0.0)
    assert out.provisional
    f.ingest(store("ghost", 2, Tier.L1, range(3, 5)), 0.0)
    assert held(f, "ghost") == {Tier.L2: 3, Tier.L1: 2}
    f.heartbeat(InstanceId("honest"), TIMEOUT)
    fenced = f.expire(TIMEOUT + 1)
    assert [(x.instance_id, x.placements, x.reason) for x in fenced] == [
        ("ghost", 5, FenceReason.EXPIRED_UNREGISTERED)
    ]
    assert held(f, "ghost") == {}
    assert held(f, "honest") == {Tier.L2: 3}  # the keys it shared keep its placements
    assert f.departed() == {}


def test_l2_of_a_departed_instance_stays_for_the_retention_then_goes() -> None:
    f = fleet()
    register(f, "a", 0.0)
    f.ingest(store("a", 1, Tier.L2, range(4)), 0.0)
    f.ingest(store("a", 2, Tier.L1, range(4, 6)), 0.0)
    gone = f.deregister(InstanceId("a"), 5.0)
    assert gone is not None and gone.placements == 2  # L1 fenced at once
    assert held(f, "a") == {Tier.L2: 4}
    assert f.departed() == {"a": (Incarnation(1), 5.0)}
    assert f.expire(5.0 + RETENTION - 1) == []
    assert held(f, "a") == {Tier.L2: 4}
    dropped = f.expire(5.0 + RETENTION)
    assert [(x.instance_id, x.placements, x.reason) for x in dropped] == [
        ("a", 4, FenceReason.L2_RETENTION)
    ]
    assert held(f, "a") == {} and f.departed() == {}
    assert f.stats().keys == 0


def test_an_expired_instance_waits_out_the_retention_from_its_expiry() -> None:
    f = fleet()
    register(f, "a", 0.0)
    f.ingest(store("a", 1, Tier.L2, range(2)), 0.0)
    expired = f.expire(TIMEOUT + 1)
    assert [x.reason for x in expired] == [FenceReason.EXPIRED]
    assert f.departed() == {"a": (Incarnation(1), TIMEOUT + 1)}
    assert f.expire(TIMEOUT + RETENTION) == []
    assert [x.reason for x in f.expire(TIMEOUT + 1 + RETENTION)] == [FenceReason.L2_RETENTION]


def test_an_instance_that_comes_back_keeps_its_l2() -> None:
    """A restarted node finds its disk again: registering (or sending events) before the
    retention ends stops the clock."""
    f = fleet()
    register(f, "a", 0.0)
    register(f, "b", 0.0)
    f.ingest(store("a", 1, Tier.L2, range(2)), 0.0)
    f.ingest(store("b", 1, Tier.L2, range(2, 4)), 0.0)
    f.deregister(InstanceId("a"), 1.0)
    f.deregister(InstanceId("b"), 1.0)
    f.register(
        InstanceInfo(InstanceId("a"), "127.0.0.1", 7000, {}, incarnation=Incarnation(2)), 50.0
    )
    f.ingest(
        EventBatch(
            InstanceId("b"), Incarnation(2), 1, EventType.STORE, Tier.L1, (Entry(key(9), 1),)
        ),
        50.0,
    )
    f.heartbeat(InstanceId("a"), 50.0 + RETENTION)
    assert f.departed() == {}
    f.expire(50.0 + RETENTION)
    assert held(f, "a") == {Tier.L2: 2}
    assert held(f, "b")[Tier.L2] == 2


def test_a_zero_retention_drops_l2_at_the_next_sweep() -> None:
    f = FleetState(instance_timeout=TIMEOUT, l2_retention=0.0)
    register(f, "a", 0.0)
    f.ingest(store("a", 1, Tier.L2, range(2)), 0.0)
    f.deregister(InstanceId("a"), 1.0)
    assert [x.reason for x in f.expire(1.0)] == [FenceReason.L2_RETENTION]
    assert held(f, "a") == {}


def test_snapshots_keep_the_retention_clocks() -> None:
    f = fleet()
    register(f, "a", 0.0)
    f.ingest(store("a", 1, Tier.L2, range(2)), 0.0)
    f.deregister(InstanceId("a"), 1000.0)
    data = f.snapshot()
    # Restarted later: the downtime counts against the retention.
    later, _ = FleetState.restore(data, now=1050.0, l2_retention=RETENTION)
    assert later.departed() == {"a": (Incarnation(1), 1000.0)}
    assert [x.reason for x in later.expire(1000.0 + RETENTION)] == [FenceReason.L2_RETENTION]
    # A clock set back: the retention counts from the restore, never from the future.
    earlier, _ = FleetState.restore(data, now=900.0, l2_retention=RETENTION)
    assert earlier.departed() == {"a": (Incarnation(1), 900.0)}
    # The operator's retention is the flag's, not the snapshot's.
    short, _ = FleetState.restore(data, now=1001.0, l2_retention=1.0)
    assert [x.reason for x in short.expire(1001.0)] == [FenceReason.L2_RETENTION]


def test_expire_departed_by_record_time_is_what_replicas_apply() -> None:
    f = fleet()
    register(f, "a", 0.0)
    f.ingest(store("a", 1, Tier.L2, range(2)), 0.0)
    assert f.expire_instance(InstanceId("a"), Incarnation(1), 0.0) is not None
    assert f.departed() == {"a": (Incarnation(1), 0.0)}  # from when it was last heard
    assert f.expire_departed(RETENTION - 1) == []
    assert [x.placements for x in f.expire_departed(RETENTION)] == [2]
