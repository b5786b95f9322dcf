"""What the attack suite's cases share: a token file, real processes started through
their CLIs with it, an authenticated client, raw loopback sockets and the resident
memory of a process.

Every fixture here starts a fresh process per test module (module scope), so a case that
breaks or fences something cannot leak into another module's cases. Must not: reach into
a process's state (cases observe it through its API, its metrics and /proc), or stop
anything but the processes it started.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvatlas.launch.procs import HOST
from support.launch import Proc
from support.services import ServerProc, start_coordinator_process, start_server_process

TOKEN = "attack-suite-token"
"""The shared token every process of the suite is started with (from a file)."""
BEARER = {"Authorization": f"Bearer {TOKEN}"}
CHUNK = 16
"""Tokens per chunk of the suite's servers."""


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("attack-token") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def coordinator(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A ``kvatlas coordinator`` process with the token from ``token_file``, snapshots
    every second into its own folder, and instances that expire after 3 s."""
    state = tmp_path_factory.mktemp("attack-coordinator")
    proc = start_coordinator_process(
        "--auth-token-file", str(token_file),
        "--snapshot-path", str(state / "snapshot"), "--snapshot-interval", "1",
        "--instance-timeout", "3", "--health-check-interval", "0.5",
        log=state / "coordinator.log",
    )  # fmt: skip
    yield proc
    proc.stop()


def start_server(workdir: Path, instance_id: str, token_file: Path, *flags: str) -> ServerProc:
    """A ``kvatlas server`` process with the token from ``token_file``: 10 MB of L1,
    chunks of CHUNK tokens, two engine-API workers (so that a case can outnumber them)."""
    return start_server_process(
        workdir, instance_id,
        "--auth-token-file", str(token_file), "--l1-size-gb", "0.01",
        "--chunk-size", str(CHUNK), "--engine-workers", "2", *flags,
    )  # fmt: skip


def client(proc: Proc) -> httpx.Client:
    """An httpx client of ``proc``'s HTTP API that carries the suite's token."""
    return httpx.Client(base_url=proc.url, headers=BEARER, timeout=10)


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    """A raw TCP connection to ``port`` on loopback."""
    return socket.create_connection((HOST, port), timeout=timeout)


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` now (VmRSS in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
