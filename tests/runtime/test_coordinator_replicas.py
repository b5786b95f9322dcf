"""The coordinator replicas' failover rule (``runtime/coordinator_replicas.py``) on a
fake clock: which replica a call asks, how long a failed one is skipped, failovers."""

from __future__ import annotations

from kvatlas.runtime.coordinator_replicas import (
    MAX_SKIP_S,
    CoordinatorUnreachable,
    Failover,
    Replicas,
    ReplicaWalk,
)

URLS = ("http://a:1", "http://b:2/", "http://c:3")


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_replica_is_skipped_doubling_up_to_the_cap_and_back_when_it_answers() -> None:
    clock = FakeClock()
    events: list[Failover] = []
    r = Replicas(URLS, timeout_s=1.0, skip_s=2.0, on_failover=events.append, clock=clock)
    assert r.urls == ("http://a:1", "http://b:2", "http://c:3") and r.order() == [0, 1, 2]
    skips = []
    for _ in range(6):
        r.failed(0)
        skips.append(r.stats().replicas[0].skipped_for_s)
    assert skips == [2.0, 4.0, 8.0, 16.0, MAX_SKIP_S, MAX_SKIP_S]
    assert r.order() == [1, 2]
    r.answered(1, "a: refused")
    assert r.url == "http://b:2" and r.order() == [1, 2]
    assert events == [Failover("http://a:1", "http://b:2", "a: refused")]
    clock.now += MAX_SKIP_S  # past its skip: half-open, asked again after the one in use
    assert r.order() == [1, 2, 0]
    r.answered(0, "")
    st = r.stats()
    assert st.url == "http://a:1" and st.failovers == 2
    assert [(x.failures, x.skipped_for_s) for x in st.replicas] == [(6, 0.0), (0, 0.0), (0, 0.0)]
    r.failed(0)
    assert r.stats().replicas[0].skipped_for_s == 2.0  # an answer restarts the doubling


def test_when_every_replica_is_skipped_a_call_asks_the_one_whose_skip_ends_first() -> None:
    clock = FakeClock()
    r = Replicas(URLS, timeout_s=1.0, skip_s=2.0, clock=clock)
    r.failed(0)
    r.failed(0)  # 4 s
    r.failed(1)  # 2 s
    clock.now += 0.5
    r.failed(2)  # 2 s, from later
    assert r.order() == [1]


def test_the_only_replica_is_never_skipped() -> None:
    r = Replicas(URLS[:1], timeout_s=1.0, clock=FakeClock())
    r.failed(0)
    r.failed(0)
    assert r.order() == [0]
    assert [(x.failures, x.skipped_for_s) for x in r.stats().replicas] == [(2, 0.0)]


def test_a_walk_stops_at_its_deadline_and_names_every_replica_it_asked() -> None:
    clock = FakeClock()
    r = Replicas(URLS, timeout_s=1.0, clock=clock)
    walk = ReplicaWalk(r, "GET", "/instances", timeout_s=1.5)
    asked = []
    for index, url, timeout in walk.attempts():
        asked.append((url, timeout))
        clock.now += timeout  # each attempt times out
        walk.no_answer(index, url, TimeoutError("slow"))
    assert asked == [("http://a:1/instances", 1.0), ("http://b:2/instances", 0.5)]
    error, cause = walk.failure()
    assert isinstance(error, CoordinatorUnreachable) and isinstance(cause, TimeoutError)
    assert "http://b:2/instances" in str(error) and "after http://a:1/instances" in str(error)
    assert r.order() == [2]  # both asked are skipped now
