"""Learned P2P deadlines: lock RPCs from the peer's RPC p99, loads from its bandwidth."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvatlas.core.server.peer_timing import LOAD_FLOOR_S, RPC_SAMPLES, DeadlinePolicy, PeerTimings
from kvatlas.core.server.peers import PeerHealth


def test_before_any_answer_the_lock_deadline_is_the_prior() -> None:
    t = PeerTimings(DeadlinePolicy(lock_prior_s=0.1))
    assert t.lock_deadline("a", cap_s=30.0) == 0.1
    assert t.fleet_rpc_p99() is None


def test_a_peer_heard_from_gets_four_times_its_p99_at_least_the_floor() -> None:
    t = PeerTimings(DeadlinePolicy(lock_floor_s=0.025, lock_p99_factor=4.0, lock_prior_s=0.1))
    for _ in range(99):
        t.observe_rpc("a", 0.002)
    assert t.lock_deadline("a", 30.0) == 0.025  # 4 x 2 ms is below the floor
    for _ in range(20):
        t.observe_rpc("a", 0.010)
    assert t.lock_deadline("a", 30.0) == pytest.approx(0.040)


def test_an_unheard_peer_borrows_the_fleets_p99() -> None:
    t = PeerTimings(DeadlinePolicy(lock_floor_s=0.025, lock_p99_factor=4.0, lock_prior_s=0.1))
    for _ in range(10):
        t.observe_rpc("a", 0.015)
    assert t.lock_deadline("b", 30.0) == pytest.approx(0.060)
    assert t.fleet_rpc_p99() == pytest.approx(0.015)


def test_the_lock_deadline_never_exceeds_the_cap() -> None:
    t = PeerTimings(DeadlinePolicy(lock_prior_s=0.1))
    assert t.lock_deadline("a", cap_s=0.03) == 0.03
    t.observe_rpc("a", 1.0)
    assert t.lock_deadline("a", cap_s=0.5) == 0.5


def test_the_ring_is_bounded_so_the_p99_follows_the_recent_peer() -> None:
    t = PeerTimings(DeadlinePolicy(lock_floor_s=0.001, lock_p99_factor=1.0))
    for _ in range(RPC_SAMPLES):
        t.observe_rpc("a", 0.5)
    for _ in range(RPC_SAMPLES):
        t.observe_rpc("a", 0.002)
    (view,) = t.views(["a"])
    assert view.rpc_samples == RPC_SAMPLES
    assert view.rpc_p99_s == pytest.approx(0.002)


def test_load_waits_the_cap_until_the_bandwidth_is_known_then_scales_with_bytes() -> None:
    t = PeerTimings(DeadlinePolicy(load_factor=4.0))
    assert t.load_deadline("a", 1 << 20, cap_s=5.0) == 5.0
    t.observe_load("a", 10 << 20, 0.1)  # 100 MiB/s
    assert t.load_deadline("a", 10 << 20, cap_s=5.0) == pytest.approx(0.4)
    assert t.load_deadline("a", 100 << 20, cap_s=5.0) == pytest.approx(4.0)
    assert t.load_deadline("a", 1000 << 20, cap_s=5.0) == 5.0
    assert t.load_deadline("a", 1024, cap_s=5.0) == LOAD_FLOOR_S


def test_a_slow_but_answering_peer_keeps_a_load_deadline_that_fits_it() -> None:
    t = PeerTimings(DeadlinePolicy(load_factor=4.0))
    nbytes = 4 * 64 * 1024
    t.observe_load("slow", nbytes, 1.2)  # 0.3 s per chunk
    assert t.load_deadline("slow", nbytes, cap_s=30.0) == pytest.approx(4.8)
    t.observe_rpc("slow", 0.002)  # its lock RPC is as fast as anyone's
    assert t.lock_deadline("slow", 30.0) == 0.025


def test_a_timed_out_load_forgets_the_bandwidth() -> None:
    t = PeerTimings()
    t.observe_load("a", 1 << 20, 0.01)
    t.load_timed_out("a")
    assert t.load_deadline("a", 1 << 20, cap_s=2.0) == 2.0


def test_bandwidth_is_an_ewma() -> None:
    t = PeerTimings()
    t.observe_load("a", 100, 1.0)
    t.observe_load("a", 200, 1.0)
    (view,) = t.views(["a"])
    assert view.bandwidth_bps == pytest.approx(130.0)


def test_forget_starts_a_new_incarnation_afresh() -> None:
    t = PeerTimings(DeadlinePolicy(lock_prior_s=0.1))
    t.observe_rpc("a", 0.5)
    t.observe_load("a", 100, 1.0)
    t.lock_deadline("a", 30.0)
    t.forget("a")
    (view,) = t.views(["a"])
    assert (view.rpc_samples, view.bandwidth_bps, view.last_lock_deadline_s) == (0, None, None)
    # the fleet still remembers: an unheard peer borrows its p99
    assert t.lock_deadline("a", 30.0) == pytest.approx(2.0)


def test_views_report_the_last_deadlines() -> None:
    t = PeerTimings()
    t.lock_deadline("a", 0.07)
    t.load_deadline("a", 100, 0.9)
    (view,) = t.views(["a"])
    assert view.last_lock_deadline_s == 0.07 and view.last_load_deadline_s == 0.9


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_nonsense_samples_are_ignored(bad: float) -> None:
    t = PeerTimings()
    t.observe_rpc("a", bad)
    t.observe_load("a", 100, bad)
    (view,) = t.views(["a"])
    assert (view.rpc_samples, view.bandwidth_bps) == (0, None)


@given(
    st.lists(st.floats(0, 10), max_size=300),
    st.floats(0.001, 100),
    st.sampled_from(["a", "b"]),
)
def test_the_lock_deadline_is_within_floor_and_cap(
    samples: list[float], cap: float, peer: str
) -> None:
    policy = DeadlinePolicy()
    t = PeerTimings(policy)
    for s in samples:
        t.observe_rpc("a", s)
    d = t.lock_deadline(peer, cap)
    assert min(cap, policy.lock_floor_s) <= d <= cap
    if not samples:
        assert d == min(cap, max(policy.lock_floor_s, policy.lock_prior_s))
        return
    recent = sorted(samples[-RPC_SAMPLES:])
    p99 = recent[math.ceil(0.99 * len(recent)) - 1]
    # peer "b" never answered: it borrows the fleet's p99, which is "a"'s here
    assert d == min(cap, max(policy.lock_floor_s, policy.lock_p99_factor * p99))


def test_an_unanswered_probe_keeps_the_breaker_open_past_the_cooloff() -> None:
    h = PeerHealth(cooloff_s=5.0, probe_after_s=0.5)
    assert h.record_failure("b", 0.0, hard=True)
    assert h.due_probes(0.5) == ["b"]
    h.record_probe_failure("b", 4.0)
    assert not h.available("b", 6.0)  # without the probe failure it would be tried at 5.0
    assert h.available("b", 9.0)
    h.record_probe_failure("c", 1.0)  # a closed peer: nothing to keep open
    assert h.available("c", 1.0)
