"""The one circuit breaker (``core/breaker.py``), on a fake clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvatlas.core.breaker import Breaker, BreakerPolicy, BreakerState


class FakeClock:
    """Time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def test_it_opens_after_threshold_failures_in_a_row_and_a_success_restarts_the_count() -> None:
    clock = FakeClock()
    b = Breaker(BreakerPolicy(threshold=3, cooloff_s=5.0))
    assert not b.record_failure(clock())
    assert not b.record_failure(clock())
    b.record_success(clock())  # the run is broken
    assert b.failures == 0
    assert not b.record_failure(clock())
    assert not b.record_failure(clock())
    assert b.state(clock()) is CLOSED and b.allows(clock())
    assert b.record_failure(clock())
    assert b.state(clock()) is OPEN and not b.allows(clock())
    assert b.opened == 1 and b.open_for(clock()) == 5.0


def test_after_its_cooloff_it_is_half_open_one_failure_reopens_it_a_success_closes_it() -> None:
    clock = FakeClock()
    b = Breaker(BreakerPolicy(threshold=2, cooloff_s=5.0))
    b.record_failure(clock())
    b.record_failure(clock())
    clock.advance(4.999)
    assert b.state(clock()) is OPEN
    clock.advance(0.001)
    assert b.state(clock()) is HALF_OPEN and b.allows(clock()) and b.open_for(clock()) == 0.0
    assert b.record_failure(clock())  # the trial failed: open again, at once
    assert b.state(clock()) is OPEN and b.opened == 2
    clock.advance(5.0)
    b.record_success(clock())  # the trial answered
    assert b.state(clock()) is CLOSED and b.failures == 0 and b.open_until == 0.0
    assert not b.record_failure(clock())  # closed: the threshold counts again


def test_failures_while_open_are_counted_but_do_not_extend_it() -> None:
    clock = FakeClock()
    b = Breaker(BreakerPolicy(threshold=1, cooloff_s=5.0))
    assert b.record_failure(clock())
    clock.advance(2.0)
    assert not b.record_failure(clock())  # work sent before it opened
    assert b.failures == 2 and b.opened == 1 and b.open_for(clock()) == 3.0


def test_a_hard_failure_opens_it_at_once_and_again_from_now_when_open() -> None:
    clock = FakeClock()
    b = Breaker(BreakerPolicy(threshold=3, cooloff_s=5.0))
    assert b.record_failure(clock(), hard=True)
    clock.advance(4.0)
    assert b.record_failure(clock(), hard=True)
    assert b.opened == 2 and b.open_for(clock()) == 5.0


def test_a_success_of_work_sent_before_it_opened_does_not_end_its_cooloff() -> None:
    clock = FakeClock()
    b = Breaker(BreakerPolicy(threshold=1, cooloff_s=5.0))
    b.record_failure(clock())
    b.record_success(clock())
    assert b.state(clock()) is OPEN and b.failures == 0
    b.close()  # it answered a call let through while open: closed whatever its state
    assert b.state(clock()) is CLOSED


def test_the_cooloff_grows_by_the_backoff_per_failure_in_a_row_up_to_its_cap() -> None:
    clock = FakeClock()
    b = Breaker(BreakerPolicy(threshold=1, cooloff_s=2.0, backoff=2.0, max_cooloff_s=30.0))
    seen = []
    for _ in range(6):
        b.record_failure(clock(), hard=True)
        seen.append(b.open_for(clock()))
    assert seen == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    b.close()
    b.record_failure(clock())
    assert b.open_for(clock()) == 2.0  # a success (here: close) restarts the growth


def test_a_long_run_of_failures_stays_at_the_cap() -> None:
    p = BreakerPolicy(threshold=1, cooloff_s=2.0, backoff=2.0, max_cooloff_s=30.0)
    assert p.cooloff(5000) == 30.0
    assert BreakerPolicy(backoff=10.0).cooloff(10_000) == math.inf


def test_trip_opens_it_whatever_the_count_and_hold_keeps_it_open() -> None:
    clock = FakeClock()
    b = Breaker(BreakerPolicy(threshold=3, cooloff_s=5.0))
    b.hold(clock())  # closed: nothing to hold
    assert b.state(clock()) is CLOSED
    b.trip(clock())  # stalled
    assert b.state(clock()) is OPEN and b.failures == 0 and b.opened == 1
    clock.advance(4.0)
    b.hold(clock())  # its probe went unanswered
    assert b.open_for(clock()) == 5.0
    clock.advance(6.0)
    assert b.state(clock()) is HALF_OPEN
    b.hold(clock())
    assert b.state(clock()) is OPEN


def test_a_cooloff_given_with_the_failure_overrides_the_policys() -> None:
    clock = FakeClock()
    b = Breaker(BreakerPolicy(threshold=1, cooloff_s=5.0))
    assert b.record_failure(clock(), cooloff_s=0.0)  # counted toward it, not taken out
    assert b.state(clock()) is HALF_OPEN and b.opened == 1
    b.trip(clock(), cooloff_s=1.0)
    assert b.open_for(clock()) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"threshold": 0}, "threshold"),
        ({"cooloff_s": -1.0}, "cool-off"),
        ({"backoff": 0.5}, "backoff"),
    ],
)
def test_a_bad_policy_is_refused_naming_what_is_wrong(kwargs: dict[str, float], word: str) -> None:
    with pytest.raises(ValueError, match=word):
        BreakerPolicy(**kwargs)  # type: ignore[arg-type]


Step = tuple[str, float]
_steps = st.lists(
    st.tuples(st.sampled_from(["fail", "hard", "ok", "trip"]), st.floats(0.0, 3.0)), max_size=40
)


@given(_steps, st.integers(1, 4))
def test_it_matches_a_plain_model(steps: list[Step], threshold: int) -> None:
    """A model written as the rules read: open iff a failure in a row reached the
    threshold (or a hard one, or a trip) and no success came since, within the cool-off."""
    clock = FakeClock()
    b = Breaker(BreakerPolicy(threshold=threshold, cooloff_s=2.0))
    run, until, is_open = 0, 0.0, False
    for op, dt in steps:
        clock.advance(dt)
        now = clock()
        blocked = is_open and now < until
        if op in ("fail", "hard"):
            run += 1
            opens = op == "hard" or (not blocked and run >= threshold)
            assert b.record_failure(now, hard=op == "hard") == opens
            if opens:
                is_open, until = True, now + 2.0
        elif op == "ok":
            b.record_success(now)
            run = 0
            if not blocked:
                is_open, until = False, 0.0
        else:
            b.trip(now)
            is_open, until = True, now + 2.0
        assert b.failures == run
        assert b.allows(now) == (not is_open or now >= until)
