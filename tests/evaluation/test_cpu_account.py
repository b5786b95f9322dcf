"""``cpu_account`` reads real ``/proc`` figures: a process's CPU seconds grow with the
work it does, the machine's busy/idle/stolen shares cover its time, and a process that
is gone reads as None (the report then leaves it out)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from kvatlas.evaluation.cpu_account import MachineTimes, machine_times, process_cpu_s
from support.launch import launch

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")


def test_a_processs_cpu_seconds_grow_with_its_work() -> None:
    before = process_cpu_s(os.getpid())
    assert before is not None
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    after = process_cpu_s(os.getpid())
    assert after is not None and after - before >= 0.2


def test_a_running_child_is_read_and_a_reaped_one_is_none() -> None:
    child = launch([sys.executable, "-c", "import time; time.sleep(30)"], name="sleeper")
    try:
        assert process_cpu_s(child.pid) is not None
    finally:
        child.kill()  # and reaped
    assert process_cpu_s(child.pid) is None
    assert process_cpu_s(None) is None


def test_machine_shares_cover_the_time_between_two_readings() -> None:
    t0 = machine_times()
    time.sleep(0.2)  # not synchronisation: the time between the two readings
    t1 = machine_times()
    assert t0 is not None and t1 is not None
    shares = t1.since(t0).shares()
    assert set(shares) == {"busy", "idle", "steal"}
    assert all(0.0 <= v <= 1.0 for v in shares.values())
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
    assert MachineTimes(0, 0, 0).shares() == {"busy": 0.0, "idle": 0.0, "steal": 0.0}
    assert MachineTimes(1.0, 2.0, 1.0).shares() == {"busy": 0.25, "idle": 0.5, "steal": 0.25}
