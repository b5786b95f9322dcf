"""Two LMCache servers with NIXL P2P find each other through kvatlas' `GET /instances`,
and one serves the other's prefix.

Both register with `p2p_advertised_url` and `mq_port`; each server's P2P controller polls
`GET /instances` every second and adds every other listed instance as a peer adapter
(its `/status` lists them). The stand-in engine of server B then asks for a prompt that
only server A stored: B's lookup finds both chunks at A, B reads them over NIXL (UCX on
loopback TCP and cross-memory attach), and the KV B's engine receives is byte for byte
what A's engine stored (the same chunk checksums). The idle CPU of both servers is
printed at the end: LMCache's NIXL progress thread is known to spin.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.wait import wait_until

from .fleet import MODEL, WAIT_S, Engine, KvatlasCoordinator, LMCacheServer, prompt

pytestmark = [pytest.mark.lmcache]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def find(obj: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in a JSON document, or None."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for item in obj:
            got = find(item, key)
            if got is not None:
                return got
    return None


def peers(server: LMCacheServer) -> list[str]:
    try:
        status = httpx.get(f"{server.http_url}/status", timeout=2).json()
    except httpx.HTTPError:
        return []
    return list(find(status, "p2p_peers") or [])


@pytest.fixture(scope="module")
def pair(lmcache_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    logs = tmp_path_factory.mktemp("lmcache-p2p")
    started: list[Any] = []
    try:
        kv = KvatlasCoordinator(logs)
        started.append(kv)
        kv.wait()
        a = LMCacheServer(logs, lmcache_venv, "mp-a", kv.url, p2p=True)
        started.append(a)
        b = LMCacheServer(logs, lmcache_venv, "mp-b", kv.url, p2p=True)
        started.append(b)
        a.wait()
        b.wait()
        ea, eb = Engine(logs, lmcache_venv, a), Engine(logs, lmcache_venv, b)
        started += [ea, eb]
        yield kv, a, b, ea, eb
    finally:
        for p in reversed(started):
            p.stop()


def test_p2p_peers_discover_each_other_through_kvatlas_and_serve_a_prefix(pair: Any) -> None:
    kv, a, b, ea, eb = pair

    def listed() -> dict[str, Any] | None:
        got = {i["instance_id"]: i for i in kv.http.get("/instances").json()["instances"]}
        return got if set(got) == {"mp-a", "mp-b"} else None

    insts = wait_until(listed, what="both registrations", timeout=WAIT_S)
    assert insts is not None
    for server in (a, b):  # registered with their P2P address and message-queue port
        inst = insts[server.instance_id]
        assert (inst["p2p_advertised_url"], inst["mq_port"]) == (server.p2p_url, server.port)
    wait_until(
        lambda: (peers(a), peers(b)) == (["mp-b"], ["mp-a"]),
        what="A and B peers of each other",
        timeout=WAIT_S,
    )
    tokens = prompt(50_000, 2)
    assert ea.call("store", tokens, rid="a-store")["ok"]
    stored = ea.call("checksums", tokens)["checksums"]
    body = {"token_ids": tokens, "model_name": MODEL, "world_size": 1}

    def holders() -> list[list[str]]:
        results = kv.http.post("/directory/lookup", json=body).json()["results"]
        return [sorted(p["instance_id"] for p in r["placements"]) for r in results]

    wait_until(
        lambda: holders() == [["mp-a"], ["mp-a"]],
        what="A's chunks in kvatlas' directory",
        timeout=WAIT_S,
    )
    got = eb.call("fetch", tokens, rid="b-fetch")
    assert (got["ok"], got["hit"]) == (True, 2), got
    assert eb.call("checksums", tokens)["checksums"] == stored
    # idle CPU of each server over two seconds, for the record
    before = {s.instance_id: cpu_seconds(s.proc.pid) for s in (a, b)}
    time.sleep(2.0)  # the idle window measured, not synchronisation
    idle = {
        s.instance_id: round((cpu_seconds(s.proc.pid) - before[s.instance_id]) / 2.0, 2)
        for s in (a, b)
    }
    print(f"idle CPU of each LMCache server with NIXL P2P, in cores: {idle}")
