"""Real processes for the P2P tests and benchmark: a coordinator (``python -m
kvatlas.cli.coordinator``) and cache servers (``python -m kvatlas.cli.server``) on
127.0.0.1, started by the one launcher and stopped by pid, and a CacheClient as each
node's engine."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.connector.client import CacheClient
from kvatlas.launch.procs import free_port, free_ports
from kvatlas.wire.directory_api import LookupRequest, LookupResponse
from support.launch import Proc
from support.services import ServerProc, start_coordinator_process, start_server_process
from support.wait import wait_until

CHUNK = 16
MODEL = "tiny"
HEARTBEAT_S = 0.2


@dataclass(eq=False, kw_only=True)
class Coordinator(Proc):
    """The fleet's coordinator process."""

    def held(self, client: CacheClient, tokens: Sequence[int]) -> dict[str, int]:
        """Per instance, how many leading chunks of ``tokens`` the directory lists."""
        req = LookupRequest(token_ids=list(tokens), model_name=MODEL)
        r = httpx.post(self.url + "/directory/lookup", content=msgspec.json.encode(req), timeout=5)
        assert r.status_code == 200, r.text
        resp = msgspec.json.decode(r.content, type=LookupResponse)
        out: dict[str, int] = {}
        for h in resp.prefix_holders:
            out[h.instance_id] = max(out.get(h.instance_id, 0), h.chunks)
        return out

    def instances(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/instances", timeout=5)
        return list(r.json()["instances"])


def start_coordinator(tmp: Path, port: int = 0) -> Coordinator:
    port = port or free_port()
    return start_coordinator_process(
        "--chunk-size", str(CHUNK), "--snapshot-interval", "0",
        "--instance-timeout", "30", "--health-check-interval", "0.5",
        port=port, log=tmp / f"coord-{port}-{time.monotonic_ns()}.log", cls=Coordinator,
    )  # fmt: skip


@dataclass(eq=False, kw_only=True)
class Node(ServerProc):
    """A cache server with P2P, and the engines (CacheClients) a test opened on it."""

    p2p_port: int
    clients: list[CacheClient] = field(default_factory=list)

    def client(self, timeout_s: float = 30.0) -> CacheClient:
        c = CacheClient(self.engine_url, timeout_s=timeout_s, engine_id=f"eng-{self.instance_id}")
        c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        self.clients.append(c)
        return c

    def peers(self) -> list[str]:
        return list(self.status()["p2p_peers"])

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> int | None:
        for c in self.clients:
            c.close()
        self.clients.clear()
        return super().stop(sig, grace_s)


def start_node(
    tmp: Path,
    instance_id: str,
    coord: Coordinator | None,
    *extra: str,
    transport: str = "tcp",
    l1_gb: float = 0.02,
    p2p_port: int | None = None,
    p2p: bool = True,
) -> Node:
    port, http_port, free_p2p_port = free_ports(3)
    p2p_port = p2p_port or free_p2p_port
    args = [
        "--l1-size-gb", str(l1_gb), "--chunk-size", str(CHUNK), "--engine-workers", "2",
        "--coordinator-heartbeat-interval", str(HEARTBEAT_S), "--event-flush-interval", "0.1",
        "--coordinator-timeout", "1", "--log-level", "DEBUG",
    ]  # fmt: skip
    if coord is not None:
        args += ["--coordinator-url", coord.url]
    if p2p:
        args += [
            "--p2p-advertise-url", f"127.0.0.1:{p2p_port}", "--p2p-transfer-engine", transport
        ]  # fmt: skip
    args += list(extra)
    node = start_server_process(
        tmp, instance_id, *args, port=port, http_port=http_port, cls=Node, p2p_port=p2p_port
    )
    assert isinstance(node, Node)
    return node


def chunk_data(n: int, size: int, seed: int) -> list[npt.NDArray[np.uint8]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def prompt(n_chunks: int, seed: int) -> list[int]:
    return [seed * 1_000_000 + i for i in range(n_chunks * CHUNK)]


@contextlib.contextmanager
def cluster(
    tmp: Path,
    *names: str,
    transport: str = "tcp",
    extra: Mapping[str, Sequence[str]] | None = None,
    l1_gb: float = 0.02,
) -> Iterator[tuple[Coordinator, list[Node]]]:
    tmp.mkdir(parents=True, exist_ok=True)
    coord = start_coordinator(tmp)
    nodes: list[Node] = []
    try:
        for name in names:
            nodes.append(
                start_node(
                    tmp,
                    name,
                    coord,
                    *(extra or {}).get(name, ()),
                    transport=transport,
                    l1_gb=l1_gb,
                )
            )
        yield coord, nodes
    finally:
        for n in nodes:
            n.stop()
        coord.stop()


def _registered_with(peers: list[str], status: dict[str, Any]) -> bool:
    return bool(status["p2p_peers"] == peers and status["p2p_state"] == "registered")


def wait_peers(nodes: Sequence[Node], timeout: float = 20.0) -> None:
    """Every node lists every other node as a P2P peer and sees itself registered."""
    for n in nodes:
        want = sorted(m.instance_id for m in nodes if m is not n)

        wait_until(
            n.status,
            partial(_registered_with, want),
            what=f"{n.instance_id} registered with peers {want}",
            timeout=timeout,
        )


def read_all(client: CacheClient, tokens: Sequence[int]) -> list[npt.NDArray[np.uint8]]:
    out = client.retrieve_prefix(tokens)
    return [np.asarray(a, dtype=np.uint8) for a in out]
