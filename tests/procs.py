"""Process helpers shared by the test suites: free loopback ports, waiting for a child's
HTTP endpoint, stopping a child by its pid. Importable as ``procs`` (pytest puts tests/
on sys.path). Only ever signals the process object it is given."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

HOST = "127.0.0.1"


def free_port(pair: bool = False) -> int:
    """A free TCP port on 127.0.0.1; with ``pair``, PORT and PORT+1 are both free (the
    tcp transfer engine listens on the P2P port + 1)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if not pair:
            return port
        if port >= 65534:
            continue
        try:
            with socket.socket() as s2:
                s2.bind((HOST, port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair on 127.0.0.1")


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    return "\n" + log.read_text(errors="replace")[-4000:]


def wait_http(
    url: str, proc: subprocess.Popen[bytes], log: Path | None = None, timeout: float = 30.0
) -> None:
    """Until ``url`` answers 200; fails early (with the log's tail) if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}{_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} did not come up in {timeout:.0f}s{_tail(log)}")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace_s: float = 20.0) -> int:
    """Send ``sig`` (SIGTERM: a clean stop), SIGKILL after ``grace_s``; the exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode
