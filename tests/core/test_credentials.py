"""Instance credentials and cursor bounds in the fleet state (`core.credentials`): who
may speak for an instance, and how far one request may move it."""

from __future__ import annotations

import pytest

from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.coordinator.gate import Verdict
from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.credentials import (
    NANOSECOND_INCARNATIONS,
    Bounds,
    credential_digest,
    incarnation_limit,
)
from kvatlas.core.errors import CredentialRefused, OutOfBounds, Unauthenticated
from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier

NOW = 1_800_000_000.0
NS = int(NOW * 1e9)
SECRET = "s" * 43
PROOF = credential_digest(SECRET)
BOUNDS = Bounds(max_seq_jump=100, max_incarnation_ahead_s=60.0)


def info(iid: str, incarnation: int, digest: bytes = b"", port: int = 1) -> InstanceInfo:
    return InstanceInfo(
        InstanceId(iid), "127.0.0.1", port, {}, incarnation=Incarnation(incarnation),
        credential_digest=digest,
    )  # fmt: skip


def batch(iid: str, incarnation: int, seq: int) -> EventBatch:
    key = ObjectKey(bytes([seq % 256]) * 32, "m", 0)
    return EventBatch(
        InstanceId(iid), Incarnation(incarnation), seq, EventType.STORE, Tier.L1,
        (Entry(key, 10),),
    )  # fmt: skip


def bound_fleet() -> FleetState:
    fleet = FleetState()
    fleet.register(info("v", NS, PROOF), NOW, bounds=BOUNDS)
    return fleet


def test_a_bound_instance_needs_its_own_proof_for_everything() -> None:
    fleet = bound_fleet()
    for proof, error in ((b"", Unauthenticated), (credential_digest("x"), CredentialRefused)):
        with pytest.raises(error):
            fleet.check_batches([batch("v", NS, 1)], proof, NOW, BOUNDS)
        with pytest.raises(error):
            fleet.register(info("v", NS + 1, port=666), NOW, proof, BOUNDS)
        with pytest.raises(error):
            fleet.deregister(InstanceId("v"), NOW, proof)
        with pytest.raises(error):
            fleet.authorize(InstanceId("v"), proof)
    assert fleet.instances()[0].http_port == 1
    assert fleet.authorize(InstanceId("v"), PROOF) is True
    fleet.check_batches([batch("v", NS, 1)], PROOF, NOW, BOUNDS)
    outcome, _ = fleet.register(info("v", NS + 1, credential_digest("new")), NOW, PROOF, BOUNDS)
    assert outcome.incarnation == NS + 1
    with pytest.raises(CredentialRefused):  # the old secret is spent
        fleet.authorize(InstanceId("v"), PROOF)
    assert fleet.deregister(InstanceId("v"), NOW, credential_digest("new")) is not None


def test_unbound_instances_pass_unless_credentials_are_required() -> None:
    fleet = FleetState()
    fleet.register(info("mp", 0), NOW, bounds=BOUNDS)
    assert fleet.authorize(InstanceId("mp"), b"") is False
    fleet.check_batches([batch("mp", int(NOW), 1)], b"", NOW, BOUNDS)
    strict = Bounds(require_credentials=True)
    with pytest.raises(Unauthenticated):
        fleet.check_batches([batch("mp", int(NOW), 1)], b"", NOW, strict)
    with pytest.raises(Unauthenticated):
        FleetState().register(info("mp", 0), NOW, bounds=strict)
    FleetState().register(info("mp", 0, PROOF), NOW, bounds=strict)


def test_seq_moves_within_the_window_of_the_cursor() -> None:
    fleet = FleetState()
    assert fleet.ingest(batch("a", 5, 50), NOW).verdict is Verdict.APPLY
    fleet.check_batches([batch("a", 5, 150)], b"", NOW, BOUNDS)
    with pytest.raises(OutOfBounds, match="--max-seq-jump"):
        fleet.check_batches([batch("a", 5, 151)], b"", NOW, BOUNDS)
    with pytest.raises(OutOfBounds):  # a new incarnation counts from 0
        fleet.check_batches([batch("a", 6, 101)], b"", NOW, BOUNDS)
    with pytest.raises(OutOfBounds):  # and so does a first batch
        fleet.check_batches([batch("b", 5, 101)], b"", NOW, BOUNDS)
    fleet.check_batches([batch("a", 4, 2**62)], b"", NOW, BOUNDS)  # stale: the gate drops it


def test_a_proven_instance_is_taken_at_its_seq_when_the_cursor_is_lost() -> None:
    fleet = bound_fleet()  # e.g. a coordinator restarted without its snapshot
    fleet.check_batches([batch("v", NS, 10**9)], PROOF, NOW, BOUNDS)
    fleet.ingest(batch("v", NS, 10**9), NOW)
    with pytest.raises(OutOfBounds):
        fleet.check_batches([batch("v", NS, 10**9 + 101)], PROOF, NOW, BOUNDS)


def test_incarnations_stay_within_the_clock_in_their_own_unit() -> None:
    assert incarnation_limit(None, NOW, 60.0) == int((NOW + 60) * 1e9)
    assert incarnation_limit(Incarnation(int(NOW)), NOW, 60.0) == int(NOW + 60)
    assert incarnation_limit(Incarnation(NANOSECOND_INCARNATIONS), NOW, 0.0) == NS
    fleet = FleetState()
    fleet.register(info("mp", 0), NOW, bounds=BOUNDS)  # LMCache: seconds from its events
    fleet.check_batches([batch("mp", int(NOW) + 60, 1)], b"", NOW, BOUNDS)
    for inc in (int(NOW) + 61, NS, 2**62):
        with pytest.raises(OutOfBounds, match="--max-incarnation-ahead-s"):
            fleet.check_batches([batch("mp", inc, 1)], b"", NOW, BOUNDS)
    with pytest.raises(OutOfBounds):
        fleet.register(info("mp", 2**62), NOW, bounds=BOUNDS)
    fleet.register(info("k", NS + 60 * 10**9), NOW, bounds=BOUNDS)
    with pytest.raises(OutOfBounds):
        fleet.register(info("k2", NS + 61 * 10**9), NOW, bounds=BOUNDS)


def test_digests_survive_a_snapshot() -> None:
    fleet = bound_fleet()
    restored, _ = FleetState.restore(fleet.snapshot())
    with pytest.raises(Unauthenticated):
        restored.authorize(InstanceId("v"), b"")
    assert restored.authorize(InstanceId("v"), PROOF) is True
