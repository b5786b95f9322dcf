"""Process helpers that tests, benchmarks and the evaluation share.

Owns picking free loopback ports (below the kernel's ephemeral range, so that no outgoing
connection of the child itself takes one before it binds; all held while they are chosen,
so that two picks in one go never collide), waiting until a process's HTTP endpoint
answers (failing early, with its log's tail, when the process exits), and asking Linux to
kill a child when its parent dies. Must not: start or signal processes (their owners do, by pid).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from kvatlas.core.errors import KvatlasError

HOST = "127.0.0.1"
"""The only address tests, benchmarks and the evaluation bind."""
_PR_SET_PDEATHSIG = 1


class ProcessError(KvatlasError):
    """A child process did not start or stopped unexpectedly."""


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10_000
"""Ports are picked from here up to the ephemeral range's start (32768 by default)."""
_RANDOM = random.SystemRandom()
"""Not the module's generator: a test that seeds it must not make two runs pick alike."""


def _pick_range() -> tuple[int, int] | None:
    """Ports [low, high) outside the kernel's ephemeral range, or None where that range
    is unknown or leaves too little room below it (then the kernel picks, port 0)."""
    try:
        first = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (_LOWEST_PORT, first) if first - _LOWEST_PORT >= 4096 else None


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1: all are held while they are
    chosen, since a port just released is often the next one handed out.

    Picked at random below the ephemeral range: a port the kernel hands out for
    port 0 is also what it hands out to outgoing connections, so a child that connects
    somewhere before it binds (an LMCache server registers first) could take its own
    port with that connection; and random picks keep concurrent test runs apart."""
    span = _pick_range()
    held: list[socket.socket] = []
    try:
        while len(held) < count:
            s = socket.socket()
            port = 0 if span is None else _RANDOM.randrange(*span)
            try:
                s.bind((HOST, port))
            except OSError as exc:
                s.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            held.append(s)
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_ports(1)[0]


def wait_http(
    url: str, proc: subprocess.Popen[bytes], log: Path | None = None, timeout: float = 30.0
) -> None:
    """Until ``url`` answers 200; ProcessError early (with the log's tail) if ``proc``
    exits, or when ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ProcessError(f"process exited with {proc.returncode}{_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        time.sleep(0.05)
    raise ProcessError(f"{url} did not come up in {timeout:.0f}s{_tail(log)}")


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    return "\n" + log.read_text(errors="replace")[-4000:]


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
