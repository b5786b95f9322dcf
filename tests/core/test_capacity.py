"""Declared capacities: LMCache's revision rules, fencing with the instance's L1 slice,
forgetting with the instance, and snapshots (a version 1 snapshot has none)."""

from __future__ import annotations

import msgspec

from kvatlas.core.coordinator.capacity import CapacityRegistry, Compartment
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.coordinator.gate import Verdict
from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.events import EventBatch, UnknownBatch
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier

GIB = 1 << 30


def config(
    iid: str, seq: int, tier: Tier, backend: str, gib: int, revision: int, incarnation: int = 7
) -> EventBatch:
    return EventBatch(
        InstanceId(iid),
        Incarnation(incarnation),
        seq,
        EventType.CONFIG,
        tier,
        (),
        backend=backend,
        capacity_bytes=gib * GIB,
        capacity_revision=revision,
    )


def places(reg: CapacityRegistry, iid: str) -> dict[tuple[Tier, str], int]:
    d = reg.get(iid)
    return {} if d is None else {(c.tier, c.backend): c.capacity_bytes for c in d.compartments}


def test_a_newer_revision_starts_afresh_the_same_extends_an_older_is_dropped() -> None:
    reg = CapacityRegistry()
    assert reg.declare("a", 1, 1, Compartment(Tier.L1, "dram", 4))
    assert reg.declare("a", 1, 1, Compartment(Tier.L2, "fs", 9))
    assert places(reg, "a") == {(Tier.L1, "dram"): 4, (Tier.L2, "fs"): 9}
    assert reg.declare("a", 1, 1, Compartment(Tier.L1, "dram", 5))  # a repeat replaces
    assert [c.backend for c in reg.get("a").compartments] == ["dram", "fs"]  # type: ignore[union-attr]
    assert reg.declare("a", 1, 2, Compartment(Tier.L1, "dram", 6))  # fs is retired
    assert places(reg, "a") == {(Tier.L1, "dram"): 6}
    assert not reg.declare("a", 1, 1, Compartment(Tier.L2, "fs", 9))  # a straggler
    assert reg.declare("a", 2, 1, Compartment(Tier.L2, "fs", 3))  # a new process
    assert places(reg, "a") == {(Tier.L2, "fs"): 3}
    assert reg.stats().declared_bytes == 3


def test_fence_below_drops_an_older_incarnations_declaration_and_forget_all() -> None:
    reg = CapacityRegistry()
    reg.declare("a", 3, 1, Compartment(Tier.L1, "dram", 4))
    reg.declare("b", 1, 1, Compartment(Tier.L2, "s3", 100, shared=True))
    assert not reg.fence_below("a", 3)
    assert reg.fence_below("a", 4)
    assert reg.get("a") is None
    assert reg.stats().declared_bytes == 0  # a shared pool is not anyone's own capacity
    assert reg.forget("b") and not reg.forget("b")
    assert reg.declarations() == {}


def test_fleet_keeps_declarations_through_the_gate_and_fences_them() -> None:
    fleet = FleetState()
    fleet.register(
        InstanceInfo(InstanceId("a"), "127.0.0.1", 1, {}, incarnation=Incarnation(7)), 0.0
    )
    out = fleet.ingest(config("a", 1, Tier.L1, "dram", 4, revision=1), 1.0)
    assert out.verdict is Verdict.APPLY and out.applied is None and not out.skipped
    # a resent config batch is a duplicate; an unknown type moves the cursor only
    assert fleet.ingest(config("a", 1, Tier.L1, "dram", 8, 1), 1.0).verdict is Verdict.DUPLICATE
    out = fleet.ingest(UnknownBatch(InstanceId("a"), Incarnation(7), 2, "pin"), 1.0)
    assert (out.verdict, out.skipped, out.gap) == (Verdict.APPLY, "pin", 0)
    assert fleet.ingest(config("a", 3, Tier.L2, "fs", 9, 1), 1.0).gap == 0
    assert places(fleet.capacity, "a") == {(Tier.L1, "dram"): 4 * GIB, (Tier.L2, "fs"): 9 * GIB}
    assert fleet.cursors[InstanceId("a")].last_seq == 3
    # a snapshot keeps the declarations with their stamps
    restored, _ = FleetState.restore(fleet.snapshot())
    assert restored.capacity.declarations() == fleet.capacity.declarations()
    # events of a new incarnation fence the old declaration; deregistration forgets
    fleet.ingest(UnknownBatch(InstanceId("a"), Incarnation(8), 1, "pin"), 2.0)
    assert fleet.capacity.get("a") is None
    fleet.ingest(config("a", 2, Tier.L1, "dram", 2, 1, incarnation=8), 2.0)
    assert places(fleet.capacity, "a") == {(Tier.L1, "dram"): 2 * GIB}
    fleet.deregister(InstanceId("a"), 3.0)
    assert fleet.capacity.declarations() == {}


def test_expiry_forgets_declarations() -> None:
    fleet = FleetState(instance_timeout=5.0)
    fleet.register(
        InstanceInfo(InstanceId("a"), "127.0.0.1", 1, {}, incarnation=Incarnation(1)), 0.0
    )
    fleet.ingest(config("a", 1, Tier.L1, "dram", 4, 1, incarnation=1), 0.0)
    fleet.ingest(config("p", 1, Tier.L1, "dram", 4, 1, incarnation=1), 0.0)  # provisional
    assert set(fleet.capacity.declarations()) == {"a", "p"}
    assert {f.instance_id for f in fleet.expire(6.0)} == {"a", "p"}
    assert fleet.capacity.declarations() == {}


def test_a_version_1_snapshot_restores_without_declarations() -> None:
    fleet = FleetState()
    fleet.register(
        InstanceInfo(InstanceId("a"), "127.0.0.1", 1, {}, incarnation=Incarnation(1)), 0.0
    )
    head = msgspec.msgpack.decode(fleet.snapshot())
    # 2 appended declarations and keep_tokens, 3 the departed instances, 4 whether the
    # chunk size is bound
    assert head[0] == 4 and len(head) == 16
    old = msgspec.msgpack.encode([1, *head[1:12]])  # what version 1 wrote
    restored, extra = FleetState.restore(old)
    assert [i.instance_id for i in restored.instances()] == ["a"]
    assert restored.capacity.declarations() == {} and extra == {}
    assert not restored.directory.keep_tokens  # version 1 kept them only with blend
    assert FleetState.restore(old, keep_tokens=True)[0].directory.keep_tokens
