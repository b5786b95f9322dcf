"""keep_freed_heap: big temporaries freed and made again stop faulting their pages in
(what a lookup of 32k JSON tokens does a dozen times per request), unless the operator
set glibc's thresholds, which are then left alone. trim_heap: the memory of freed
bodies kept inside the heap goes back to the system."""

from __future__ import annotations

import os
import subprocess
import sys

CHURN = """
import resource, sys, numpy as np
from kvatlas.coordinator.host.allocator import keep_freed_heap
def churn():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(200):
        a = np.ones(1 << 15, np.uint64); b = a + 1; c = b * 2; d = c - a; del a, b, c, d
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
churn()
default = churn()
kept = keep_freed_heap()
churn()
print(default, kept, churn())
"""


def run(extra_env: dict[str, str]) -> tuple[int, bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHURN],
        env={**os.environ, **extra_env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    return int(out[0]), out[1] == "True", int(out[2])


def test_freed_temporaries_stop_faulting() -> None:
    default, kept, after = run({})
    assert kept
    assert default > 10_000  # glibc's defaults: pages faulted in on every round
    assert after < default // 10


def test_the_operators_thresholds_win() -> None:
    _, kept, after = run({"MALLOC_TRIM_THRESHOLD_": "1"})
    assert not kept and after > 10_000


TRIM = """
from kvatlas.coordinator.host.allocator import keep_freed_heap, trim_heap
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
keep_freed_heap()  # 256 KiB blocks come from the heap, as the server's bodies do
live, bodies = [], []
for _ in range(400):
    bodies.append(bytearray(256 * 1024))
    live.append(bytearray(1024))  # live blocks between them: holes, not the heap's top
del bodies
freed = rss()
print(freed, trim_heap(), rss())
"""


def test_trim_gives_freed_bodies_memory_back() -> None:
    """100 MiB of bodies freed between live blocks stay resident until the trim."""
    out = subprocess.run(
        [sys.executable, "-c", TRIM], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    freed, trimmed, after = int(out[0]), out[1] == "True", int(out[2])
    assert trimmed
    assert freed - after > 64 << 20, (freed, after)
