"""A real LMCache 0.5.6 server against `kvatlas coordinator`, answer for answer beside
LMCache's own coordinator.

One fleet for the module: `lmcache server` ``mp-a`` (MP mode, CPU) reports to a `Tee`
that sends each of its calls to a kvatlas coordinator (whose answer the server gets) and
then to LMCache's coordinator, recording both answers. Its stand-in engine stores and
retrieves KV through LMCache's own client path (CPU tensors over POSIX shared memory).
So both coordinators receive the very same calls: registration without an incarnation,
heartbeats, `POST /events` with config, store, access and delete batches, heartbeat
expiry and re-registration, and `DELETE /instances/mp-a`. The tests compare the two
answers to every call, and to the same lookups; where they differ by design the test
names the difference (docs/migrating-from-lmcache.md, "kvatlas as the coordinator of an
LMCache fleet", says why).

The tests run in file order and share the fleet: registration, capacity, stores,
accesses, deletions, evictions, expiry, deregistration.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

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

TIMEOUT_S = 4
"""Instance timeout of both coordinators: a paused server expires within seconds."""
L1_GB = 0.00390625
"""4 MiB, 32 chunks of 128 KiB: a handful of prompts makes LRU evict."""
KIB128 = CHUNK * 512  # two layers x two heads x 16 floats x K and V per token
PROMPT = prompt(1000, 2)

KVATLAS_ONLY = {
    "POST /instances": {"incarnation"},
    "POST /events": {"gaps", "missing_seqs", "provisional", "skipped"},
}
"""Fields kvatlas adds to LMCache's answers (its extensions; LMCache's clients ignore
them): a registration's incarnation, and the gate's gap and skip counts."""
DIFFERENT = {("POST /instances", "re_registered")}
"""Fields both answer, with another meaning. `re_registered`: kvatlas says whether the
id was seen before, live or gone (it remembers every id's incarnations, to refuse stale
processes); LMCache whether a live registration was replaced. They differ for a server
that comes back after it expired; LMCache's servers only log the field."""


@dataclass
class Fleet:
    kv: KvatlasCoordinator
    lm: LMCacheCoordinator
    tee: Tee
    server: LMCacheServer
    engine: Engine

    @property
    def coordinators(self) -> tuple[KvatlasCoordinator, LMCacheCoordinator]:
        return (self.kv, self.lm)


def get(coord: KvatlasCoordinator | LMCacheCoordinator, path: str) -> Any:
    r = coord.http.get(path)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def lookup(coord: KvatlasCoordinator | LMCacheCoordinator, tokens: list[int]) -> Any:
    body = {"token_ids": tokens, "model_name": MODEL, "world_size": 1}
    r = coord.http.post("/directory/lookup", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def held(coord: KvatlasCoordinator | LMCacheCoordinator, tokens: list[int]) -> list[list[str]]:
    """Per full chunk of ``tokens``: the instances holding it."""
    return [[p["instance_id"] for p in r["placements"]] for r in lookup(coord, tokens)["results"]]


def both_hold(fleet: Fleet, tokens: list[int], want: list[list[str]]) -> bool:
    return all(held(c, tokens) == want for c in fleet.coordinators)


def instance(coord: KvatlasCoordinator | LMCacheCoordinator) -> dict[str, Any] | None:
    for inst in get(coord, "/instances")["instances"]:
        if inst["instance_id"] == "mp-a":
            out: dict[str, Any] = inst
            return out
    return None


def registered(coord: KvatlasCoordinator | LMCacheCoordinator) -> dict[str, Any]:
    inst = instance(coord)
    assert inst is not None, f"mp-a is not registered at {coord}"
    return inst


@pytest.fixture(scope="module")
def fleet(lmcache_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("lmcache-fleet")
    flags = ("--instance-timeout", str(TIMEOUT_S), "--health-check-interval", "0.5")
    started: list[Any] = []
    try:
        kv = KvatlasCoordinator(logs, *flags)
        started.append(kv)
        lm = LMCacheCoordinator(logs, lmcache_venv, *flags)
        started.append(lm)
        kv.wait()
        lm.wait()
        tee = Tee(kv.url, lm.url)
        started.append(tee)
        server = LMCacheServer(logs, lmcache_venv, "mp-a", tee.url, l1_gb=L1_GB)
        started.append(server)
        server.wait()
        engine = Engine(logs, lmcache_venv, server)
        started.append(engine)
        yield Fleet(kv, lm, tee, server, engine)
        # every call the server made, with both answers, for the reader of the logs
        with (logs / "calls.jsonl").open("w") as out:
            for e in tee.exchanges:
                sent, mine, theirs = e.json()
                row = {"call": f"{e.method} {e.path}", "sent": sent}
                row |= {"kvatlas": [e.kv_status, mine], "lmcache": [e.lm_status, theirs]}
                out.write(json.dumps(row) + "\n")
    finally:
        for p in reversed(started):
            p.stop()


def assert_same_answers(fleet: Fleet, method: str, path: str) -> int:
    """Every recorded call ``method path...``: the same status and, but for kvatlas'
    documented extensions (`KVATLAS_ONLY`), the same answer. Returns how many."""
    calls = fleet.tee.calls(method, path)
    route = f"{method} {path.rstrip('/')}"
    for e in calls:
        _, mine, theirs = e.json()
        assert e.kv_status == e.lm_status, (e.path, mine, theirs)
        if isinstance(theirs, dict) and e.kv_status == 200:
            extra = KVATLAS_ONLY.get(route, set())
            assert set(mine) == set(theirs) | extra, (e.path, mine, theirs)
            same = {k for k in theirs if (route, k) not in DIFFERENT}
            assert {k: mine[k] for k in same} == {k: theirs[k] for k in same}, (mine, theirs)
    return len(calls)


def test_registration_without_incarnation_and_heartbeats(fleet: Fleet) -> None:
    """`POST /instances` carries no incarnation; the events carry the process start time.
    kvatlas takes the incarnation from the events (the instance is registered, never
    provisional) and lists every field LMCache's coordinator lists, with the same
    values. Differences: kvatlas writes "no P2P" as null where LMCache writes "" and 0,
    and adds incarnation, last_heartbeat and heartbeat_age_s."""
    kv, lm = fleet.kv, fleet.lm
    mine = wait_until(lambda: instance(kv), what="a registration", timeout=WAIT_S)
    theirs = wait_until(lambda: instance(lm), what="a registration", timeout=WAIT_S)
    assert mine is not None and theirs is not None
    [register] = fleet.tee.calls("POST", "/instances")
    sent, answer, _ = register.json()
    assert "incarnation" not in sent
    assert (sent["p2p_advertised_url"], sent["mq_port"]) == ("", 0)
    assert answer == {"instance_id": "mp-a", "re_registered": False, "incarnation": 0}
    assert assert_same_answers(fleet, "POST", "/instances") == 1
    for field in ("ip", "http_port", "metadata"):
        assert mine[field] == theirs[field], field
    assert mine["http_port"] == fleet.server.http_port
    assert (theirs["p2p_advertised_url"], theirs["mq_port"]) == ("", 0)
    assert (mine["p2p_advertised_url"], mine["mq_port"]) == (None, None)  # named difference
    assert set(mine) - set(theirs) == {"incarnation", "last_heartbeat", "heartbeat_age_s"}
    # the first event batch (the config flush) brings the incarnation, which the
    # registered instance takes: never a provisional one
    stats = wait_until(
        lambda: get(kv, "/directory/stats"),
        lambda st: st["cursors"],
        what="the first events",
        timeout=WAIT_S,
    )
    [cursor] = stats["cursors"]
    assert stats["provisional_instances"] == []
    assert abs(cursor["incarnation"] - mine["registration_time"]) < 120
    assert (
        wait_until(lambda: registered(kv)["incarnation"], what="the incarnation", timeout=WAIT_S)
        == cursor["incarnation"]
    )
    # heartbeats every second keep it fresh
    first = registered(kv)["last_heartbeat"]
    wait_until(lambda: registered(kv)["last_heartbeat"] > first, what="a heartbeat", timeout=5)
    assert registered(kv)["heartbeat_age_s"] < 2.5
    # the tee records a call once both coordinators answered it: kvatlas may be first
    wait_until(
        lambda: assert_same_answers(fleet, "PUT", "/instances/mp-a/heartbeat"),
        lambda n: n >= 1,
        what="a heartbeat answered by both coordinators",
        timeout=5,
    )


def test_capacity_declarations_read_the_same(fleet: Fleet) -> None:
    """The server opens its event stream with a config batch; kvatlas refused the whole
    body with 400 before. Both coordinators now answer every `POST /events`
    alike and `GET /instances/usage` identically."""
    for coord in fleet.coordinators:
        wait_until(
            partial(get, coord, "/instances/usage"),
            lambda usage: usage["instances"],
            what="a declaration",
            timeout=WAIT_S,
        )
    mine, theirs = get(fleet.kv, "/instances/usage"), get(fleet.lm, "/instances/usage")
    assert mine == theirs
    [inst] = mine["instances"]
    [dram] = inst["modules"]
    assert (inst["registered"], inst["declared_capacity"]) == (True, True)
    assert (dram["tier"], dram["backend"], dram["used_bytes"]) == ("l1", "dram", 0)
    assert dram["capacity_bytes"] == int(L1_GB * (1 << 30))
    first = fleet.tee.calls("POST", "/events")[0].json()[0]["batches"][0]
    assert (first["event_type"], first["capacity_revision"]) == ("config", 1)
    assert assert_same_answers(fleet, "POST", "/events") >= 1
    metrics = fleet.kv.http.get("/metrics").text
    assert 'ingest_batches_total{outcome="invalid"' not in metrics
    assert 'kvatlas_coordinator_config_batches_total{transport="http"} 1.0' in metrics


def test_a_stored_chunk_appears_in_the_tokens_lookup_with_its_token_ids(fleet: Fleet) -> None:
    """STORE through LMCache's client path -> kvatlas' tokens-form lookup finds both
    chunks at mp-a with their token ids, exactly as LMCache's coordinator does.
    Difference: kvatlas adds `prefix_holders` (who holds how long a prefix)."""
    assert fleet.engine.call("store", PROMPT, rid="store-1") == {
        "ok": True,
        "hit": 0,
        "error": None,
    }
    wait_until(
        lambda: both_hold(fleet, PROMPT, [["mp-a"], ["mp-a"]]),
        what="the stored chunks",
        timeout=WAIT_S,
    )
    mine, theirs = lookup(fleet.kv, PROMPT), lookup(fleet.lm, PROMPT)
    assert mine["chunks"] == theirs["chunks"] == 2
    assert mine["results"] == theirs["results"]
    assert [r["token_ids"] for r in mine["results"]] == [PROMPT[:CHUNK], PROMPT[CHUNK : 2 * CHUNK]]
    assert [p["size_bytes"] for r in mine["results"] for p in r["placements"]] == [KIB128] * 2
    assert mine["prefix_holders"] == [
        {"instance_id": "mp-a", "tier": "l1", "chunks": 2, "tokens": 2 * CHUNK}
    ]
    assert "prefix_holders" not in theirs
    # the keys form answers the same too
    keys = {"keys": [r["key"] for r in mine["results"]]}
    mine_k, theirs_k = (
        c.http.post("/directory/lookup", json=keys).json() for c in fleet.coordinators
    )
    assert mine_k["results"] == theirs_k["results"] == mine["results"]
    for coord in fleet.coordinators:
        [module] = get(coord, "/instances/usage")["instances"][0]["modules"]
        assert module["used_bytes"] == 2 * KIB128
    assert assert_same_answers(fleet, "POST", "/events") >= 2


def test_access_counts_move(fleet: Fleet) -> None:
    """A second request of the same prompt hits both chunks; the ACCESS events it causes
    move the access counts alike at both coordinators."""
    before = [r["access_count"] for r in lookup(fleet.kv, PROMPT)["results"]]
    got = fleet.engine.call("fetch", PROMPT, rid="fetch-1")
    assert (got["ok"], got["hit"]) == (True, 2)

    def counts(coord: KvatlasCoordinator | LMCacheCoordinator) -> list[int]:
        return [r["access_count"] for r in lookup(coord, PROMPT)["results"]]

    def moved() -> bool:
        mine = counts(fleet.kv)
        return mine == counts(fleet.lm) and all(a > b for a, b in zip(mine, before, strict=True))

    wait_until(moved, what="the access counts", timeout=WAIT_S)
    sent = [b for e in fleet.tee.calls("POST", "/events") for b in e.json()[0]["batches"]]
    assert any(b["event_type"] == "access" and b["backend"] == "" for b in sent)


def test_deletions_remove_placements(fleet: Fleet) -> None:
    """`DELETE /cache/objects` on the server drops the chunks from its L1; its DELETE
    events remove the placements at both coordinators, which still agree."""
    keys = [r["key"] for r in lookup(fleet.kv, PROMPT)["results"]]
    with httpx.Client(base_url=fleet.server.http_url, timeout=10) as http:
        r = http.request(
            "DELETE", "/cache/objects", json={"keys": keys, "tier": "l1", "force": True}
        )
    assert r.status_code == 200 and r.json()["deleted"] == 2, r.text
    wait_until(lambda: both_hold(fleet, PROMPT, [[], []]), what="the deletes", timeout=WAIT_S)
    assert lookup(fleet.kv, PROMPT)["results"] == lookup(fleet.lm, PROMPT)["results"]
    for coord in fleet.coordinators:
        [module] = get(coord, "/instances/usage")["instances"][0]["modules"]
        assert module["used_bytes"] == 0


def test_evictions_remove_placements(fleet: Fleet) -> None:
    """Prompts beyond the L1's capacity make LMCache's LRU evict the oldest one (and
    skip stores that find no room); the eviction DELETE events leave both coordinators
    with the chunks the server really holds."""
    prompts = [prompt(10_000 + 3000 * i, 6) for i in range(8)]  # 48 chunks, L1 holds 32
    assert fleet.engine.call("store", prompts[0], rid="evict-0")["ok"]
    wait_until(
        lambda: both_hold(fleet, prompts[0], [["mp-a"]] * 6),
        what="the first prompt",
        timeout=WAIT_S,
    )
    for i, p in enumerate(prompts[1:], 1):
        assert fleet.engine.call("store", p, rid=f"evict-{i}")["ok"]

    def settled() -> bool:
        mine = [held(fleet.kv, p) for p in prompts]
        theirs = [held(fleet.lm, p) for p in prompts]
        return mine == theirs and mine[0] == [[]] * 6 and [["mp-a"]] * 6 in mine

    wait_until(settled, what="the eviction of the first prompt", timeout=20, every=0.5)
    mine, theirs = get(fleet.kv, "/instances/usage"), get(fleet.lm, "/instances/usage")
    assert mine == theirs
    [module] = mine["instances"][0]["modules"]
    assert 0 < module["used_bytes"] <= module["capacity_bytes"]


def test_heartbeat_expiry_fences_and_the_server_comes_back(fleet: Fleet) -> None:
    """A paused server sends no heartbeat: both coordinators expire it and drop its L1
    placements. Resumed, it gets 404 on its next heartbeat, registers again and
    redeclares its capacity. Differences: kvatlas forgets an expired instance's capacity
    declaration at once; LMCache forgets it only on deregistration, so until the server
    redeclares it lists the instance as unregistered with a capacity. And the second
    registration's `re_registered` is true at kvatlas, false at LMCache (`DIFFERENT`)."""
    one = prompt(80_000, 1)
    assert fleet.engine.call("store", one, rid="before-expiry")["ok"]
    wait_until(lambda: both_hold(fleet, one, [["mp-a"]]), what="a stored chunk", timeout=WAIT_S)
    fleet.server.pause()
    try:
        for coord in fleet.coordinators:
            wait_until(
                partial(instance, coord),
                lambda inst: inst is None,
                what="the expiry",
                timeout=TIMEOUT_S + 10,
            )
        wait_until(lambda: both_hold(fleet, one, [[]]), what="the fence", timeout=5)
        assert "expired after more than" in fleet.kv.log_text()
        assert get(fleet.kv, "/instances/usage")["instances"] == []
        [gone] = get(fleet.lm, "/instances/usage")["instances"]
        assert (gone["registered"], gone["declared_capacity"]) == (False, True)
    finally:
        fleet.server.resume()
    for coord in fleet.coordinators:
        wait_until(partial(instance, coord), what="the re-registration", timeout=15)

    def redeclared() -> bool:
        mine = get(fleet.kv, "/instances/usage")
        return bool(mine["instances"]) and mine == get(fleet.lm, "/instances/usage")

    wait_until(redeclared, what="the new declaration", timeout=15)
    assert [e.kv_status for e in fleet.tee.calls("PUT", "/instances/mp-a/heartbeat")].count(404)
    _, again = fleet.tee.calls("POST", "/instances")
    assert assert_same_answers(fleet, "POST", "/instances") == 2
    assert (again.json()[1]["re_registered"], again.json()[2]["re_registered"]) == (True, False)
    after = prompt(90_000, 1)  # the server's events apply again
    assert fleet.engine.call("store", after, rid="after-expiry")["ok"]
    wait_until(
        lambda: both_hold(fleet, after, [["mp-a"]]), what="a store after the expiry", timeout=WAIT_S
    )


def test_deregistration_fences(fleet: Fleet) -> None:
    """A server that stops (SIGINT) sends `DELETE /instances/mp-a` on its way out: both
    coordinators drop the instance, its L1 placements and its declaration at once (well
    before the instance timeout would)."""
    again = prompt(90_000, 1)
    fleet.engine.stop()
    fleet.server.stop()
    [delete] = fleet.tee.calls("DELETE", "/instances/mp-a")
    assert (delete.kv_status, delete.lm_status) == (204, 204)
    for coord in fleet.coordinators:
        assert instance(coord) is None
        assert held(coord, again) == [[]]
        assert get(coord, "/instances/usage") == {"instances": [], "shared_modules": []}
    assert "Deregistered instance mp-a" in fleet.kv.log_text()
    # over the whole run, every call of each kind was answered alike
    for method, path in (("POST", "/instances"), ("PUT", "/instances/"), ("POST", "/events")):
        assert_same_answers(fleet, method, path)
