"""A hold on how long this machine's CPUs may take to wake: a PM QoS request.

Owns one open file of the kernel's CPU latency QoS device (``/dev/cpu_dma_latency``):
while it is open, the kernel keeps every idle CPU in a state it leaves within the held
number of microseconds. At 0 an idle CPU polls instead of halting, so that a process
woken by a socket runs at once. On a virtual machine this matters most: a halted vCPU
runs again only when the hypervisor schedules it, which can take far longer than a
lookup itself (`docs/benchmarks.md` has the figures). The price is that idle CPUs spin:
the host sees them busy.

Must not: change anything that outlives the process. The kernel drops the request when
the file is closed, by `close` or by the process ending, however it ends.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Final

DEVICE = Path("/dev/cpu_dma_latency")
"""The kernel's device (a module variable, so that tests can name another)."""
NO_LIMIT_US: Final = 2_000_000_000
"""The kernel's value when nothing is held (PM_QOS_CPU_LATENCY_DEFAULT_VALUE)."""
_VALUE = struct.Struct("=i")


class CpuLatencyError(Exception):
    """The request could not be made; the message says why and what it needs."""


class CpuLatencyHold:
    """Holds "wake within ``us`` microseconds" for every CPU until `close`.

    Several holds (of this or other processes) may exist at once: the kernel keeps the
    lowest. For a block, ``contextlib.closing(CpuLatencyHold(us))``. ``device``:
    `DEVICE` when None (tests name another)."""

    def __init__(self, us: int, device: Path | None = None) -> None:
        self._fd: int | None = None
        device = DEVICE if device is None else device
        if not 0 <= us <= NO_LIMIT_US:
            raise ValueError(f"a CPU latency limit is 0-{NO_LIMIT_US} us, got {us}")
        try:
            fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            why = (
                "this kernel has no CPU latency QoS device"
                if isinstance(exc, FileNotFoundError)
                else "the kernel's CPU latency QoS device; opening it needs root"
            )
            raise CpuLatencyError(f"cannot open {device}: {exc.strerror} ({why})") from exc
        try:
            written = os.write(fd, _VALUE.pack(us))
        except OSError as exc:
            os.close(fd)
            raise CpuLatencyError(f"cannot write {us} to {device}: {exc.strerror}") from exc
        if written != _VALUE.size:
            os.close(fd)
            raise CpuLatencyError(f"{device} took {written} of {_VALUE.size} bytes")
        self.us = us
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        """Drop the request (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


def why_not_held() -> str | None:
    """None where this process can hold a CPU latency request, else why not (opens the
    device and closes it at once; the request it holds meanwhile limits nothing)."""
    try:
        CpuLatencyHold(NO_LIMIT_US).close()
    except CpuLatencyError as exc:
        return str(exc)
    return None


def current_limit_us(device: Path | None = None) -> int | None:
    """The limit the kernel keeps now, over every holder (``NO_LIMIT_US``: none);
    None when the device cannot be read."""
    device = DEVICE if device is None else device
    try:
        with device.open("rb") as f:
            raw = f.read(_VALUE.size)
    except OSError:
        return None
    if len(raw) != _VALUE.size:
        return None
    value: int = _VALUE.unpack(raw)[0]
    return value
