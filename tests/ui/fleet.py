"""A small real fleet for the fleet page's tests: a coordinator (`python -m
kvatlas.cli.coordinator`) with a short instance timeout and cache servers (`python -m
kvatlas.cli.server`) with P2P over tcp, all on 127.0.0.1, started by the one launcher
and stopped by pid; traffic through a real CacheClient (stores on one server, P2P reads
on another)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvatlas.connector.client import CacheClient
from kvatlas.launch.procs import HOST, free_ports
from support.launch import Proc
from support.services import ServerProc, start_coordinator_process, start_server_process
from support.wait import wait_until

CHUNK = 16
MODEL = "tiny"
HEARTBEAT_S = 0.25
INSTANCE_TIMEOUT_S = 4.0


@dataclass(eq=False, kw_only=True)
class Node(ServerProc):
    """A cache server, and the engines (CacheClients) a test opened on it."""

    token: str = ""
    clients: list[CacheClient] = field(default_factory=list)

    def client(self) -> CacheClient:
        c = CacheClient(
            self.engine_url,
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

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> int | None:
        self.close_clients()
        return super().stop(sig, grace_s)


@dataclass
class Fleet:
    tmp: Path
    token: str
    coordinator: Proc
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.coordinator.url

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
        args = [
            "--l1-size-gb", "0.02", "--chunk-size", str(CHUNK), "--engine-workers", "2",
            "--coordinator-url", self.url,
            "--coordinator-heartbeat-interval", str(HEARTBEAT_S),
            "--event-flush-interval", "0.1", "--coordinator-timeout", "1",
            "--p2p-advertise-url", f"{HOST}:{p2p}", "--p2p-transfer-engine", "tcp",
        ]  # fmt: skip
        if self.token:
            args += ["--auth-token", self.token]
        node = start_server_process(
            self.tmp, name, *args, port=port, http_port=http_port, cls=Node, token=self.token
        )
        assert isinstance(node, Node)
        self.nodes.append(node)
        return node


@contextmanager
def fleet(
    tmp: Path, *names: str, token: str = "", instance_timeout: float = INSTANCE_TIMEOUT_S
) -> Iterator[Fleet]:
    """A coordinator and one server per name, each registered before this yields."""
    tmp.mkdir(parents=True, exist_ok=True)
    flags = [
        "--chunk-size", str(CHUNK), "--snapshot-interval", "0",
        "--instance-timeout", str(instance_timeout), "--health-check-interval", "0.25",
    ]  # fmt: skip
    if token:
        flags += ["--auth-token", token]
    coordinator = start_coordinator_process(*flags, log=tmp / "coordinator.log")
    fl = Fleet(tmp, token, coordinator)
    try:
        for name in names:
            fl.start_node(name)
        wait_until(fl.member_ids, lambda ids: ids == sorted(names), what=f"{names} registered")
        yield fl
    finally:
        for n in fl.nodes:
            n.stop()
        coordinator.stop()


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
    return wait_until(
        lambda: reader.lookup(tokens).hit_chunks,
        lambda hit: hit == n_chunks,
        what=f"seed {seed}: the reader's server reads the chunks from its peer",
        timeout=20,
    )
