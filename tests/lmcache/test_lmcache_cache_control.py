"""`kvatlas coordinator` driving a real LMCache 0.5.6 server's cache control, as LMCache's
own coordinator does, call for call.

One fleet for the module: `lmcache server` ``mp-c`` (MP mode, CPU, L1 plus LMCache's
in-memory ``mock`` L2 adapter) registers and reports through a `Tee` to a kvatlas coordinator and to
LMCache's coordinator, so both know it by the same registration (``ip``,
``http_port``). Its stand-in engine stores KV through LMCache's own client path. The
tests then ask both coordinators the same things: ``POST /cache/prefetches`` and its
poll ``GET /cache/prefetches/mp-c/{request_id}`` (a warm load from L2 into L1) and
``POST /cache/delete`` per tier; the answers must be the same, and the server's DELETE
and STORE events must reach both directories alike.

The tests run in file order and share the fleet. The last one turns it round: LMCache's
coordinator drives a kvatlas server, as kvatlas' coordinator does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.connector.client import CacheClient
from kvatlas.launch.procs import HOST
from support.services import start_server_process
from support.wait import wait_until

from .fleet import (
    CHUNK,
    MODEL,
    WAIT_S,
    Engine,
    KvatlasCoordinator,
    LMCacheCoordinator,
    LMCacheServer,
    Tee,
    prompt,
)

pytestmark = [pytest.mark.lmcache]

PROMPT = prompt(50_000, 3)
"""Three chunks (and the token that is never cached)."""

Coord = KvatlasCoordinator | LMCacheCoordinator


@dataclass
class Fleet:
    kv: KvatlasCoordinator
    lm: LMCacheCoordinator
    server: LMCacheServer
    engine: Engine

    @property
    def coordinators(self) -> tuple[KvatlasCoordinator, LMCacheCoordinator]:
        return (self.kv, self.lm)


@pytest.fixture(scope="module")
def fleet(lmcache_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("lmcache-cache-control")
    started: list[Any] = []
    try:
        kv = KvatlasCoordinator(logs, "--eviction-check-interval", "0")
        started.append(kv)
        lm = LMCacheCoordinator(logs, lmcache_venv)
        started.append(lm)
        kv.wait()
        lm.wait()
        tee = Tee(kv.url, lm.url)
        started.append(tee)
        server = LMCacheServer(logs, lmcache_venv, "mp-c", tee.url, l2_gb=0.0625)
        started.append(server)
        server.wait()
        engine = Engine(logs, lmcache_venv, server)
        started.append(engine)
        yield Fleet(kv, lm, server, engine)
    finally:
        for p in reversed(started):
            p.stop()


def held(coord: Coord, tokens: list[int]) -> list[list[str]]:
    """Per full chunk: "instance/tier" of each placement the directory lists."""
    body = {"token_ids": tokens, "model_name": MODEL, "world_size": 1}
    r = coord.http.post("/directory/lookup", json=body)
    assert r.status_code == 200, r.text
    return [
        sorted(f"{p['instance_id']}/{p['tier']}" for p in res["placements"])
        for res in r.json()["results"]
    ]


def both_hold(fleet: Fleet, tokens: list[int], want: list[list[str]]) -> None:
    wait_until(
        lambda: [held(c, tokens) for c in fleet.coordinators],
        lambda got: got == [want, want],
        what=f"both directories to list {want}",
        timeout=WAIT_S,
    )


def delete(coord: Coord, tier: str, tokens: list[int] = PROMPT, **extra: Any) -> dict[str, Any]:
    body = {
        "instance_id": "mp-c",
        "model_name": MODEL,
        "world_size": 1,
        "token_ids": tokens,
        "tier": tier,
        **extra,
    }
    r = coord.http.post("/cache/delete", json=body)
    assert r.status_code == 200, (type(coord).__name__, r.text)
    out: dict[str, Any] = r.json()
    return out


def prefetch(coord: Coord, tokens: list[int] = PROMPT) -> dict[str, Any]:
    body = {"instance_id": "mp-c", "model_name": MODEL, "world_size": 1, "token_ids": tokens}
    r = coord.http.post("/cache/prefetches", json=body)
    assert r.status_code == 200, (type(coord).__name__, r.text)
    out: dict[str, Any] = r.json()
    return out


def poll(coord: Coord, request_id: str) -> dict[str, Any]:
    return poll_at(coord, "mp-c", request_id)


def test_stored_chunks_reach_l2(fleet: Fleet) -> None:
    assert fleet.engine.call("store", PROMPT, rid="cc-store")["ok"]
    both_hold(fleet, PROMPT, [["mp-c/l1", "mp-c/l2"]] * 3)


def test_delete_l1_answers_alike_and_leaves_l2(fleet: Fleet) -> None:
    mine = delete(fleet.kv, "l1")
    assert mine == {
        "instance_id": "mp-c",
        "requested": 3,
        "affected": 3,
        "skipped": 0,
        "status": "deleted",
    }
    both_hold(fleet, PROMPT, [["mp-c/l2"]] * 3)
    # LMCache's coordinator, asked the same on the same state (nothing left in L1).
    theirs = delete(fleet.lm, "l1")
    again = delete(fleet.kv, "l1")
    assert theirs == again == {**mine, "affected": 0}


def test_prefetch_through_kvatlas_warms_l1_as_lmcache_does(fleet: Fleet) -> None:
    sub = prefetch(fleet.kv)
    assert sub["instance_id"] == "mp-c" and sub["status"] == "submitted"
    assert sub["chunks"] == 3 and sub["request_id"]
    done = poll(fleet.kv, sub["request_id"])
    assert done == {
        "request_id": sub["request_id"],
        "status": "completed",
        "found_keys": 3,
        "total_keys": 3,
    }
    both_hold(fleet, PROMPT, [["mp-c/l1", "mp-c/l2"]] * 3)
    # The job is gone once polled done: the server's 404, relayed by both.
    for coord in fleet.coordinators:
        r = coord.http.get(f"/cache/prefetches/mp-c/{sub['request_id']}")
        assert r.status_code == 404, r.text
        assert "unknown prefetch request_id" in r.json()["detail"]
    # The same through LMCache's coordinator, from the same state.
    delete(fleet.kv, "l1")
    both_hold(fleet, PROMPT, [["mp-c/l2"]] * 3)
    theirs = prefetch(fleet.lm)
    assert set(theirs) == set(sub) and theirs["chunks"] == 3
    assert theirs["status"] == "submitted"
    done_lm = poll(fleet.lm, theirs["request_id"])
    assert {k: v for k, v in done_lm.items() if k != "request_id"} == {
        k: v for k, v in done.items() if k != "request_id"
    }
    both_hold(fleet, PROMPT, [["mp-c/l1", "mp-c/l2"]] * 3)


def test_prefetch_of_less_than_a_chunk_answers_alike(fleet: Fleet) -> None:
    mine, theirs = prefetch(fleet.kv, [1, 2, 3]), prefetch(fleet.lm, [1, 2, 3])
    assert (
        mine == theirs == {"instance_id": "mp-c", "request_id": "", "chunks": 0, "status": "noop"}
    )


def test_delete_all_answers_alike_and_empties_both_tiers(fleet: Fleet) -> None:
    other = prompt(60_000, 2)
    assert fleet.engine.call("store", other, rid="cc-other")["ok"]
    both_hold(fleet, other, [["mp-c/l1", "mp-c/l2"]] * 2)
    mine = delete(fleet.kv, "all")
    # LMCache's server counts L1 removals plus the whole L2 batch.
    assert (mine["requested"], mine["affected"], mine["skipped"]) == (3, 6, 0), mine
    both_hold(fleet, PROMPT, [[]] * 3)
    theirs = delete(fleet.lm, "all", other)
    assert (theirs["requested"], theirs["affected"], theirs["skipped"]) == (2, 4, 0), theirs
    both_hold(fleet, other, [[]] * 2)
    with httpx.Client(base_url=fleet.server.http_url, timeout=10) as http:
        usage = http.get("/quota/_default").json()
    assert usage["current_usage_gb"] == 0.0, usage
    # Again, on nothing: both count the L2 batch whole, present or not.
    assert (
        delete(fleet.kv, "all", other)
        == delete(fleet.lm, "all", other)
        == {
            **theirs,
            "affected": 2,
        }
    )


def test_unknown_instance_is_a_404_at_both(fleet: Fleet) -> None:
    body = {"instance_id": "nobody", "model_name": MODEL, "world_size": 1, "token_ids": PROMPT}
    for coord in fleet.coordinators:
        for path in ("/cache/prefetches", "/cache/delete"):
            r = coord.http.post(path, json=body)
            assert r.status_code == 404, (path, r.text)
            assert "nobody" in r.json()["detail"]


def test_lmcaches_coordinator_drives_a_kvatlas_server_alike(fleet: Fleet, tmp_path: Path) -> None:
    """The other way round: a kvatlas server, known to LMCache's coordinator by the
    registration it makes (ip, http_port), serves LMCache's coordinator's prefetch and
    delete as kvatlas' coordinator's. Chunks of 64 KiB in an L1 of 256 KiB: storing
    seven demotes the first three to the server's L2."""
    node = start_server_process(
        tmp_path, "kv-s",
        "--chunk-size", str(CHUNK), "--l1-size-gb", str(2**18 / 2**30),
        "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.01",
        "--coordinator-url", fleet.kv.url, "--event-flush-interval", "0.05",
    )  # fmt: skip
    engine = CacheClient(node.engine_url, timeout_s=10, engine_id="kv-s-engine")
    try:
        r = fleet.lm.http.post(
            "/instances", json={"instance_id": "kv-s", "ip": HOST, "http_port": node.http_port}
        )
        assert r.status_code == 200, r.text
        engine.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        tokens = prompt(70_000, 3)
        blobs = [np.full(64 * 1024, i, np.uint8) for i in range(7)]
        assert engine.store_chunks(tokens, blobs[:3]).stored == 3
        engine.store_chunks(prompt(80_000, 4), blobs[3:])
        wait_until(
            lambda: held(fleet.kv, tokens),
            lambda got: got == [["kv-s/l2"]] * 3,
            what="the prompt in kv-s's L2",
            timeout=WAIT_S,
        )
        body = {"instance_id": "kv-s", "model_name": MODEL, "world_size": 1, "token_ids": tokens}
        answers = {}
        for coord in fleet.coordinators:
            sub = coord.http.post("/cache/prefetches", json=body)
            assert sub.status_code == 200, sub.text
            done = poll_at(coord, "kv-s", sub.json()["request_id"])
            answers[type(coord).__name__] = (sub.json()["chunks"], done["found_keys"])
        assert set(answers.values()) == {(3, 3)}, answers
        assert engine.lookup(tokens, acquire=False).hit_chunks == 3
        mine = fleet.kv.http.post("/cache/delete", json={**body, "tier": "l1"}).json()
        theirs = fleet.lm.http.post("/cache/delete", json={**body, "tier": "l1"}).json()
        assert (mine["affected"], theirs["affected"]) == (3, 0), (mine, theirs)
        assert {k: v for k, v in mine.items() if k != "affected"} == {
            k: v for k, v in theirs.items() if k != "affected"
        }
        theirs = fleet.lm.http.post("/cache/delete", json={**body, "tier": "all"}).json()
        assert (theirs["requested"], theirs["affected"], theirs["skipped"]) == (3, 3, 0), theirs
        wait_until(
            lambda: held(fleet.kv, tokens),
            lambda got: got == [[]] * 3,
            what="kv-s's DELETE events at kvatlas' coordinator",
            timeout=WAIT_S,
        )
    finally:
        engine.close()
        fleet.lm.http.delete("/instances/kv-s")
        assert node.stop() == 0, node.tail()


def poll_at(coord: Coord, iid: str, request_id: str) -> dict[str, Any]:
    def status() -> dict[str, Any]:
        r = coord.http.get(f"/cache/prefetches/{iid}/{request_id}")
        assert r.status_code == 200, (type(coord).__name__, r.text)
        out: dict[str, Any] = r.json()
        return out

    return wait_until(
        status, lambda job: job["status"] == "completed", what="the prefetch completed",
        timeout=WAIT_S,
    )  # fmt: skip
