"""Peer reconciliation, peer health and P2P deadlines."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvatlas.core.server.peers import ActionKind, PeerEndpoint, PeerHealth, PeerTable, p2p_deadline


def ep(iid: str, port: int = 8555, inc: int = 1) -> PeerEndpoint:
    return PeerEndpoint(iid, f"127.0.0.1:{port}", inc)


def kinds(actions: list) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return [(a.kind.value, a.peer.instance_id) for a in actions]


def test_adds_peers_but_never_itself_nor_peers_without_endpoint() -> None:
    t = PeerTable("node-a")
    acts = t.reconcile([ep("node-a"), ep("node-b"), PeerEndpoint("node-c", "")])
    assert kinds(acts) == [("add", "node-b")]
    assert [p.instance_id for p in t.peers()] == ["node-b"]


def test_removed_after_three_listings_without_it() -> None:
    t = PeerTable("node-a")
    t.reconcile([ep("node-b")])
    assert t.reconcile([]) == []
    assert t.reconcile([]) == []
    assert kinds(t.reconcile([])) == [("remove", "node-b")]
    assert len(t) == 0


def test_a_reappearance_resets_the_miss_count() -> None:
    t = PeerTable("node-a")
    t.reconcile([ep("node-b")])
    t.reconcile([])
    t.reconcile([])
    assert t.reconcile([ep("node-b")]) == []
    t.reconcile([])
    t.reconcile([])
    assert len(t) == 1


def test_changed_endpoint_or_incarnation_rebuilds() -> None:
    t = PeerTable("node-a")
    t.reconcile([ep("node-b")])
    assert kinds(t.reconcile([ep("node-b", port=9999)])) == [("rebuild", "node-b")]
    assert kinds(t.reconcile([ep("node-b", port=9999, inc=2)])) == [("rebuild", "node-b")]
    assert t.reconcile([ep("node-b", port=9999, inc=2)]) == []


@given(st.lists(st.sets(st.sampled_from(["a", "b", "c", "d"])), max_size=20))
def test_table_matches_a_simple_model(listings: list[set[str]]) -> None:
    t = PeerTable("a")
    misses: dict[str, int] = {}
    live: set[str] = set()
    for listing in listings:
        acts = t.reconcile([ep(i) for i in sorted(listing)])
        present = listing - {"a"}
        for i in present:
            misses[i] = 0
        for i in live - present:
            misses[i] += 1
        removed = {i for i in live - present if misses[i] >= 3}
        assert {a.peer.instance_id for a in acts if a.kind is ActionKind.REMOVE} == removed
        assert {a.peer.instance_id for a in acts if a.kind is ActionKind.ADD} == present - live
        live = (live | present) - removed
        assert {p.instance_id for p in t.peers()} == live


def test_health_cools_off_after_repeated_failures() -> None:
    h = PeerHealth(threshold=2, cooloff_s=5.0)
    assert not h.record_failure("b", 0.0)
    assert h.available("b", 0.0)
    assert h.record_failure("b", 1.0)
    assert not h.available("b", 2.0)
    assert h.cooling(2.0) == ["b"]
    assert h.available("b", 6.0)
    h.record_failure("b", 7.0)
    h.record_success("b")
    assert not h.record_failure("b", 8.0)


def test_deadline_follows_the_recompute_time() -> None:
    assert p2p_deadline(30.0, None) == 30.0
    assert p2p_deadline(30.0, 0.8) == 0.8
    assert p2p_deadline(30.0, 100.0) == 30.0
    assert p2p_deadline(30.0, 0.001) == 0.05
    assert p2p_deadline(30.0, 0.5, factor=2.0) == 1.0


def test_a_hard_failure_opens_the_breaker_at_once() -> None:
    h = PeerHealth(threshold=3, cooloff_s=5.0, probe_after_s=0.5)
    assert h.record_failure("b", 1.0, hard=True)
    assert not h.available("b", 1.1)
    assert h.cooling(1.1) == ["b"] and h.opened == 1
    assert not h.record_failure("b", 1.2, hard=True)  # already open: not opened again
    assert h.opened == 1


def test_probes_are_due_at_doubling_intervals_up_to_the_cooloff() -> None:
    h = PeerHealth(cooloff_s=3.0, probe_after_s=0.5)
    h.record_failure("b", 0.0, hard=True)
    assert h.due_probes(0.4) == []
    assert h.due_probes(0.5) == ["b"]
    assert h.due_probes(1.0) == []  # next one at 0.5 + 1.0
    assert h.due_probes(1.5) == ["b"]
    assert h.due_probes(3.4) == []  # next gap 2.0
    assert h.due_probes(3.5) == ["b"]
    assert h.due_probes(6.4) == []  # capped at the cooloff: 3.0
    assert h.due_probes(6.5) == ["b"]


def test_an_answered_probe_or_a_new_incarnation_closes_the_breaker() -> None:
    h = PeerHealth(cooloff_s=5.0, probe_after_s=0.5)
    h.record_failure("b", 0.0, hard=True)
    h.record_failure("c", 0.0, hard=True)
    h.record_success("b")  # its probe answered
    h.forget("c")  # it came back with a new incarnation
    assert h.available("b", 0.1) and h.available("c", 0.1)
    assert h.due_probes(10.0) == [] and h.cooling(0.1) == []
