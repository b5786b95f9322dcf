"""Process helpers shared by the test suites: free loopback ports (the fleet runner's),
waiting for a child's HTTP endpoint, stopping a child by its pid. Importable as
``procs`` (pytest puts tests/ on sys.path). Only ever signals the process object it is
given."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

import httpx

from kvatlas.evaluation.fleet import free_port, free_ports

HOST = "127.0.0.1"
__all__ = ["HOST", "free_port", "free_ports", "stop", "wait_http"]


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
