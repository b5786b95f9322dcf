"""Process helpers that tests, benchmarks and the evaluation share.

Owns picking free loopback ports (all held while they are chosen, so that two picks in
one go never collide), waiting until a process's HTTP endpoint answers (failing early,
with its log's tail, when the process exits), and asking Linux to kill a child when its
parent dies. Must not: start or signal processes (their owners do, by pid).
"""

from __future__ import annotations

import contextlib
import ctypes
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


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1: all are held while they are
    chosen, since a port just released is often the next one handed out."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket()
            held.append(s)
            s.bind((HOST, 0))
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
