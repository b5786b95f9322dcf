"""Where a run's CPU went: seconds per process, and the machine's own accounting.

Owns two readings of Linux's ``/proc``: a process's CPU seconds (user + system, its
threads included) and the machine's CPU time split into busy, idle and stolen (time the
hypervisor gave this VM's CPUs to someone else). The routing phase reads both before and
after each run, so its report says how much CPU each kind of process used and whether
the machine itself was slower during one run than another (steal). Elsewhere (no
``/proc``) every reading is None and the report leaves the columns out. Must not: keep
state or start anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far; None when it cannot be read."""
    if pid is None:
        return None
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class MachineTimes:
    """The machine's CPU time so far, all CPUs together, in seconds."""

    busy: float
    idle: float
    steal: float

    def since(self, before: MachineTimes) -> MachineTimes:
        return MachineTimes(
            self.busy - before.busy, self.idle - before.idle, self.steal - before.steal
        )

    def shares(self) -> dict[str, float]:
        """Busy, idle and stolen as shares of the time all CPUs had."""
        total = self.busy + self.idle + self.steal
        if total <= 0:
            return {"busy": 0.0, "idle": 0.0, "steal": 0.0}
        return {
            "busy": round(self.busy / total, 4),
            "idle": round(self.idle / total, 4),
            "steal": round(self.steal / total, 4),
        }


def machine_times() -> MachineTimes | None:
    """The first line of ``/proc/stat``; None when it cannot be read."""
    try:
        line = Path("/proc/stat").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    v = [int(x) for x in line.split()[1:]]
    if len(v) < 8:
        return None
    idle = v[3] + v[4]
    steal = v[7]
    busy = v[0] + v[1] + v[2] + v[5] + v[6]
    return MachineTimes(busy / _TICK, idle / _TICK, steal / _TICK)
