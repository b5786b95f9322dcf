"""Process helpers shared by the test suites: free loopback ports and waiting for a
child's HTTP endpoint (the fleet runner's), stopping a child by its pid. Importable as
``procs`` (pytest puts tests/ on sys.path). Only ever signals the process object it is
given."""

from __future__ import annotations

import signal
import subprocess

from kvatlas.runtime.procs import free_port, free_ports, wait_http

HOST = "127.0.0.1"
__all__ = ["HOST", "free_port", "free_ports", "stop", "wait_http"]


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
