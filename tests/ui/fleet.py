"""A small real fleet for the fleet page's tests: a coordinator (`python -m
kvatlas.cli.coordinator`) with a short instance timeout and cache servers (`python -m
kvatlas.cli.server`) with P2P over tcp, all on 127.0.0.1, started and stopped by pid;
traffic through a real CacheClient (stores on one server, P2P reads on another)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvatlas.connector.client import CacheClient
from procs import HOST, free_port, free_ports, stop, wait_http

CHUNK = 16
MODEL = "tiny"
HEARTBEAT_S = 0.25
INSTANCE_TIMEOUT_S = 4.0


def wait_until(cond: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class Node(Proc):
    port: int = 0
    http_port: int = 0
    token: str = ""
    clients: list[CacheClient] = field(default_factory=list)

    def client(self) -> CacheClient:
        c = CacheClient(
            f"tcp://{HOST}:{self.port}",
            timeout_s=10.0,
            engine_id=f"e-{self.name}",
            auth_token=self.token or None,
        )
        c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        self.clients.append(c)
        return c

    def close_clients(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()


@dataclass
class Fleet:
    tmp: Path
    token: str
    coordinator: Proc
    port: int
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=10)

    def fleet_json(self) -> dict[str, Any]:
        r = self.get("/ui/fleet.json")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def member_ids(self) -> list[str]:
        r = self.get("/instances")
        return sorted(i["instance_id"] for i in r.json()["instances"])

    def start_node(self, name: str) -> Node:
        port, http_port, p2p = free_ports(3)
        log = self.tmp / f"{name}-{port}.log"
        args = [
            sys.executable, "-m", "kvatlas.cli.server",
            "--host", HOST, "--port", str(port), "--http-port", str(http_port),
            "--instance-id", name, "--l1-size-gb", "0.02", "--chunk-size", str(CHUNK),
            "--state-dir", str(self.tmp / "state"), "--engine-workers", "2",
            "--coordinator-url", self.url,
            "--coordinator-heartbeat-interval", str(HEARTBEAT_S),
            "--event-flush-interval", "0.1", "--coordinator-timeout", "1",
            "--p2p-advertise-url", f"{HOST}:{p2p}", "--p2p-transfer-engine", "tcp",
        ]  # fmt: skip
        if self.token:
            args += ["--auth-token", self.token]
        with log.open("wb") as f:
            proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
        node = Node(name, proc, log, port, http_port, self.token)
        self.nodes.append(node)
        wait_http(f"http://{HOST}:{http_port}/healthz", proc, log)
        return node


@contextmanager
def fleet(
    tmp: Path, *names: str, token: str = "", instance_timeout: float = INSTANCE_TIMEOUT_S
) -> Iterator[Fleet]:
    """A coordinator and one server per name, each registered before this yields."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = tmp / f"coordinator-{port}.log"
    args = [
        sys.executable, "-m", "kvatlas.cli.coordinator", "--host", HOST, "--port", str(port),
        "--chunk-size", str(CHUNK), "--snapshot-interval", "0",
        "--instance-timeout", str(instance_timeout), "--health-check-interval", "0.25",
    ]  # fmt: skip
    if token:
        args += ["--auth-token", token]
    with log.open("wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
    fl = Fleet(tmp, token, Proc("coordinator", proc, log), port)
    try:
        wait_http(f"{fl.url}/healthz", proc, log)
        for name in names:
            fl.start_node(name)
        wait_until(lambda: fl.member_ids() == sorted(names), what=f"{names} registered")
        yield fl
    finally:
        for n in fl.nodes:
            n.close_clients()
            stop(n.proc, signal.SIGTERM)
        stop(proc)


def prompt(n_chunks: int, seed: int) -> list[int]:
    return [seed * 1_000_000 + i for i in range(n_chunks * CHUNK)]


def store_and_share(owner: CacheClient, reader: CacheClient, seed: int, n_chunks: int = 8) -> int:
    """Store ``n_chunks`` on the owner's server, then look them up on the reader's (which
    reads them from the owner over P2P once the directory lists them); the reader's hit
    chunks."""
    tokens = prompt(n_chunks, seed)
    rng = np.random.default_rng(seed)
    owner.store_chunks(
        tokens, [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(n_chunks)]
    )
    got = 0

    def shared() -> bool:
        nonlocal got
        got = reader.lookup(tokens).hit_chunks
        return got == n_chunks

    wait_until(shared, 20, f"seed {seed}: the reader's server reads the chunks from its peer")
    return got
