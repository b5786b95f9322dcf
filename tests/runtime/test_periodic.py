"""Periodic: passes at the interval, a failing pass logged and retried, a prompt stop."""

from __future__ import annotations

import threading
import time

import pytest

from kvatlas.runtime.periodic import Periodic


def test_passes_run_at_the_interval_and_stop_ends_them() -> None:
    ran = threading.Semaphore(0)
    p = Periodic("t-pass", 0.01, ran.release)
    p.start()
    p.start()  # a second start is a no-op
    for _ in range(3):
        assert ran.acquire(timeout=5)
    assert p.stop() and p.passes >= 3
    n = p.passes
    time.sleep(0.05)  # not synchronisation: five intervals in which no pass may run
    assert p.passes == n  # never after stop() returned


def test_a_pass_that_raises_is_logged_and_the_next_one_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []
    again = threading.Event()

    def task() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        again.set()

    p = Periodic("t-fail", 0.01, task, what="the test sweep")
    p.start()
    assert again.wait(5)
    p.stop()
    assert p.failures == 1
    assert "the test sweep failed" in caplog.text


def test_no_pass_at_start_and_a_long_interval_stops_at_once() -> None:
    p = Periodic("t-long", 3600, lambda: None)
    p.start()
    t0 = time.monotonic()
    assert p.stop() and time.monotonic() - t0 < 1 and p.passes == 0


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Periodic("t-bad", 0, lambda: None)
