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
from kvatlas.launch.procs import ProcessError
from kvatlas.runtime.region import L1Region
from kvatlas.transfer.base import Endpoint, FaultPlan
from kvatlas.transfer.factory import TRANSPORTS, make_transport
from support.launch import launch, python_module
from support.wait import wait_until

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
    """An owner started with ``python -m transfer.harness`` by the one launcher (its
    stderr in a log file, stdin and stdout the line protocol); stop() or kill() it."""

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
        args = ["--transport", transport, "--size", str(size), "--seed", str(seed)]
        if token:
            args += ["--token", token]
        for lease in leases:
            args += ["--lease", ",".join(map(str, lease))]
        if corrupt_read is not None:
            args += ["--corrupt-read", str(corrupt_read)]
        self.proc = launch(
            python_module("transfer.harness", *args),
            name=f"{transport}-owner",
            env=python_env(),
            pipes=True,
        )
        self.pid = self.proc.pid
        found: list[Endpoint] = []

        def read_endpoint() -> None:
            stdout = self.proc.popen.stdout
            assert stdout is not None
            for line in stdout:
                if line.startswith("ENDPOINT "):
                    found.append(Endpoint.from_builtins(json.loads(line[9:])))
                    return

        # a thread reads the line, so that the wait can also see the owner die
        threading.Thread(target=read_endpoint, daemon=True).start()

        def announced() -> bool:
            if not self.proc.alive() and not found:
                raise ProcessError(f"{transport} owner exited:\n{self.proc.tail()}")
            return bool(found)

        try:
            wait_until(announced, what=f"the {transport} owner's ENDPOINT line", timeout=timeout_s)
        except BaseException:
            self.kill()
            raise
        self.endpoint = found[0]

    def region_checksum(self) -> int:
        stdin, stdout = self.proc.popen.stdin, self.proc.popen.stdout
        assert stdin is not None and stdout is not None
        stdin.write("checksum\n")
        stdin.flush()
        for line in stdout:
            if line.startswith("CHECKSUM "):
                return int(line.split()[1])
        raise RuntimeError("owner exited before answering")

    def kill(self) -> None:
        self.proc.kill()

    def stop(self) -> None:
        """Resume it if stopped, close its stdin (its signal to leave), SIGKILL after 10 s."""
        if self.proc.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            stdin = self.proc.popen.stdin
            assert stdin is not None
            with contextlib.suppress(OSError):
                stdin.close()
            with contextlib.suppress(AssertionError):
                self.proc.wait_exit(10)
        self.proc.kill()

    def __enter__(self) -> OwnerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def owner_main(argv: Sequence[str] | None = None) -> int:

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
