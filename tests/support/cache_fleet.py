"""The fleet of the cache-control tests: a real coordinator served from a thread of the
test process, and real ``kvatlas server`` processes reporting to it, each with a
CacheClient as its engine. Chunks of 64 KiB in an L1 of 1 MiB (16 slots) and a disk L2,
so a test moves chunks into L2 by storing past what L1 holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvatlas.connector.client import CacheClient
from support.coordinator import RunningCoordinator
from support.services import ServerProc, start_server_process
from support.wait import wait_until

CHUNK = 16
MODEL = "tiny"
CHUNK_BYTES = 64 * 1024
L1_GB = str(2**20 / 2**30)
"""1 MiB: 16 chunks of 64 KiB."""


@dataclass(eq=False, kw_only=True)
class Node(ServerProc):
    token: str = ""
    clients: list[CacheClient] = field(default_factory=list)

    def client(self) -> CacheClient:
        c = CacheClient(
            self.engine_url, timeout_s=10.0, engine_id=f"eng-{self.instance_id}",
            auth_token=self.token or None,
        )  # fmt: skip
        c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        self.clients.append(c)
        return c

    def http(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=10, **kw)

    def stop(self, *args: Any, **kw: Any) -> int | None:
        for c in self.clients:
            c.close()
        self.clients.clear()
        return super().stop(*args, **kw)


def start_node(
    tmp: Path, instance_id: str, coord: RunningCoordinator | None, *extra: str, l2: bool = True
) -> Node:
    args = [
        "--l1-size-gb", L1_GB, "--chunk-size", str(CHUNK), "--engine-workers", "2",
        "--event-flush-interval", "0.05", "--coordinator-heartbeat-interval", "0.5",
    ]  # fmt: skip
    if l2:
        args += ["--l2-path", str(tmp / f"l2-{instance_id}"), "--l2-size-gb", "0.05"]
    token = ""
    if coord is not None:
        args += ["--coordinator-url", coord.url]
        token = coord.config.auth_token
    if token:
        args += ["--auth-token", token]
    node = start_server_process(tmp, instance_id, *args, *extra, cls=Node, token=token)
    assert isinstance(node, Node)
    if coord is not None:
        wait_until(
            coord.instance_ids,
            lambda ids: instance_id in ids,
            what=f"{instance_id} to register",
            timeout=20,
        )
    return node


def prompt(chunks: int, seed: int) -> list[int]:
    """``chunks`` full chunks of tokens, plus one token that is never cached."""
    return [seed * 100_000 + i for i in range(chunks * CHUNK + 1)]


def data(chunks: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8) for _ in range(chunks)]


def placements(coord: RunningCoordinator, tokens: Sequence[int], salt: str = "") -> list[set[str]]:
    """Per complete chunk of ``tokens``: the "instance/tier" placements the directory lists."""
    body = {"token_ids": list(tokens), "model_name": MODEL, "cache_salt": salt}
    r = coord.client.post("/directory/lookup", json=body)
    assert r.status_code == 200, r.text
    return [
        {f"{p['instance_id']}/{p['tier']}" for p in res["placements"]}
        for res in r.json()["results"]
    ]


def wait_placements(
    coord: RunningCoordinator, tokens: Sequence[int], want: list[set[str]], salt: str = ""
) -> None:
    wait_until(
        lambda: placements(coord, tokens, salt),
        lambda got: got == want,
        what=f"placements {want}",
        timeout=20,
    )


def poll_prefetch(coord: RunningCoordinator, iid: str, request_id: str) -> dict[str, Any]:
    """Poll until the job completed; its completed answer."""

    def status() -> dict[str, Any]:
        r = coord.client.get(f"/cache/prefetches/{iid}/{request_id}")
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        if body["status"] != "completed":
            assert body == {"request_id": request_id, "status": "pending"}
        return body

    return wait_until(
        status, lambda job: job["status"] == "completed", what="prefetch completed", timeout=30
    )
