"""Owner processes for the transfer tests and benchmark: a real L1 region in a real second
process, serving through a real transport, that a test can SIGKILL or SIGSTOP by pid.

    python -m transfer.harness --transport tcp --size N [--seed S] [--token T]
        [--lease PEER,LEASE,OFFSET,SIZE ...] [--corrupt-read N]

prints ``ENDPOINT <json>`` once serving, then answers ``checksum`` lines on stdin with
``CHECKSUM <int>`` (of the whole region) and exits when stdin closes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvatlas.core.checksum import checksum
from kvatlas.transfer.base import Endpoint, FaultPlan
from kvatlas.transfer.factory import TRANSPORTS, make_transport

TESTS_DIR = Path(__file__).resolve().parent.parent
NETNS_TRANSPORTS = frozenset({"mooncake"})
"""Transports that listen on 0.0.0.0 whatever they are told: run them in a private netns."""


def pattern(size: int, seed: int = 1) -> npt.NDArray[np.uint8]:
    """The bytes an owner's region holds: reproducible in the requester."""
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


def importable(transport: str) -> str | None:
    """None when the transport's package imports; otherwise the reason."""
    try:
        make_transport(transport)
    except Exception as exc:
        return str(exc)
    return None


def netns_available() -> bool:
    """Whether this machine lets an unprivileged process make a private network
    namespace (``unshare -rn``) and bring its loopback up."""
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(
        ["unshare", "-rn", "sh", "-c", "ip link set lo up"], check=False, capture_output=True
    )
    return r.returncode == 0


def netns_command(argv: Sequence[str]) -> list[str]:
    """``argv`` run inside a private network namespace that has only loopback."""
    script = 'ip link set lo up && exec "$@"'
    return ["unshare", "-rn", "sh", "-c", script, "sh", *argv]


def python_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PYTHONPATH": f"{TESTS_DIR}{os.pathsep}{path}" if path else str(TESTS_DIR),
    }


class OwnerProcess:
    """An owner started with ``python -m transfer.harness``; stop() or kill() it."""

    def __init__(
        self,
        transport: str,
        size: int,
        *,
        seed: int = 1,
        token: str | None = None,
        leases: Sequence[tuple[str, str, int, int]] = (),
        corrupt_read: int | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        args = [sys.executable, "-m", "transfer.harness", "--transport", transport]
        args += ["--size", str(size), "--seed", str(seed)]
        if token:
            args += ["--token", token]
        for lease in leases:
            args += ["--lease", ",".join(map(str, lease))]
        if corrupt_read is not None:
            args += ["--corrupt-read", str(corrupt_read)]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        self.pid = self.proc.pid
        self.stderr: list[str] = []
        self._stderr_reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self._stderr_reader.start()
        found: list[Endpoint] = []

        def wait_endpoint() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("ENDPOINT "):
                    found.append(Endpoint.from_builtins(json.loads(line[9:])))
                    return

        reader = threading.Thread(target=wait_endpoint, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            self.kill()
            raise RuntimeError(f"{transport} owner did not start:\n" + "".join(self.stderr[-30:]))
        self.endpoint = found[0]

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def region_checksum(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("checksum\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("CHECKSUM "):
                return int(line.split()[1])
        raise RuntimeError("owner exited before answering")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._close_pipes()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        self._stderr_reader.join(5)  # the process is gone: its stderr hits EOF
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def __enter__(self) -> OwnerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def owner_main(argv: Sequence[str] | None = None) -> int:
    from kvatlas.runtime.region import L1Region

    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", required=True, choices=TRANSPORTS)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--token")
    parser.add_argument("--lease", action="append", default=[])
    parser.add_argument("--corrupt-read", type=int)
    args = parser.parse_args(argv)
    leases = []
    for text in args.lease:
        peer, lease, offset, size = text.split(",")
        leases.append((peer, lease, int(offset), int(size)))

    def authorize(peer: str, lease: str, offset: int, size: int) -> bool:
        return any(
            p == peer and lid == lease and o <= offset and offset + size <= o + s
            for p, lid, o, s in leases
        )

    transport = make_transport(args.transport)
    with L1Region.create(args.size, "owner") as region:
        np.copyto(region.array, pattern(args.size, args.seed))
        server = transport.server(
            region, authorize, token=args.token, faults=FaultPlan(corrupt_read=args.corrupt_read)
        )
        endpoint = server.start()
        print("ENDPOINT " + json.dumps(endpoint.to_builtins()), flush=True)
        try:
            for line in sys.stdin:
                if line.strip() == "checksum":
                    print(f"CHECKSUM {checksum(region.buffer)}", flush=True)
        finally:
            server.stop()
            del server
    return 0


if __name__ == "__main__":
    sys.exit(owner_main())
