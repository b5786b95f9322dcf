"""One hand-written scenario per LMCache route: valid calls and the faults a client
makes (bad bodies, unknown ids, wrong tiers), in an order that makes each answer say
something (a listing after stores, a status after a quota). The generated sequences
(``test_generated.py``) cover what these do not think of; these make sure every route
and every listed difference is met in every run of the suite."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable

import httpx

from support.wait import wait_until

from .differences import Call
from .harness import Target, body
from .ops import CHUNK, Run, tokens

Scenario = Callable[[Run], None]
SCENARIOS: dict[str, Scenario] = {}
SCENARIO_VERSIONS: dict[object, tuple[str, ...]] = {}
"""The LMCache versions a scenario runs against (absent: every one): what it sends only
that version's servers send."""


def scenario(*routes: str, versions: tuple[str, ...] = ()) -> Callable[[Scenario], Scenario]:
    def add(fn: Scenario) -> Scenario:
        for r in routes:
            SCENARIOS[r] = fn
        if versions:
            SCENARIO_VERSIONS[fn] = versions
        return fn

    return add


def _store_chain(
    run: Run,
    n: int,
    toks: list[int],
    salt: str = "",
    tier: str = "l1",
    backend: str = "dram",
    shared: bool = False,
) -> list[str]:
    hashes = run.chain(toks, salt)
    chunks = [toks[i * CHUNK : (i + 1) * CHUNK] for i in range(len(hashes))]
    run.place(
        n, "store", hashes, tier=tier, backend=backend, shared=shared, token_ids=chunks, salt=salt
    )
    return hashes


@scenario(
    "POST /instances",
    "PUT /instances/{instance_id}/heartbeat",
    "DELETE /instances/{instance_id}",
    "GET /instances",
)
def membership(run: Run) -> None:
    run.register(1)
    run.register(
        2, port=9000, metadata={"zone": "a"}, p2p_advertised_url="127.0.0.1:8555", mq_port=5555
    )
    run.get("/instances")
    run.heartbeat(1)
    run.send("PUT", f"/instances/{run.iid(9)}/heartbeat", kind="unknown-id")
    run.register(1)  # a live registration replaced
    run.deregister(2)
    run.deregister(2)  # idempotent
    run.get("/instances")
    run.register(2)  # the id again, after it left
    for bad in (
        {"instance_id": run.iid(3), "http_port": 1},
        {"instance_id": run.iid(3), "ip": "", "http_port": 1},
        {"instance_id": run.iid(3), "ip": "h", "http_port": 0},
        {"instance_id": run.iid(3), "ip": "h", "http_port": 70000},
        {"instance_id": run.iid(3), "ip": "h", "http_port": 1, "mq_port": -1},
    ):
        run.send("POST", "/instances", bad, kind="invalid")
    run.send("POST", "/instances", b"{not json", kind="invalid")
    run.register_unnamed()
    run.register(4, future_field={"from": "a newer server"})  # skipped, not refused
    run.get("/instances")
    # a straggler L1 batch of an instance that left (`departed-l1-applied`, 0.5.7)
    hashes = run.chain(tokens(run_base(run), 2))
    run.register(6)
    run.place(6, "store", hashes[:1])
    run.deregister(6)
    run.place(6, "store", hashes[1:], kind="departed-l1")
    run.lookup_keys(hashes, kind="after-departed-l1")
    run.register(6)  # LMCache 0.5.7 takes its L1 batches again
    run.place(6, "delete", hashes[1:])  # both without the straggler's placement again
    run.place(6, "store", hashes[1:])
    run.lookup_keys(hashes)


@scenario("POST /events")
def events(run: Run) -> None:
    run.register(1)
    run.config(1, "l1", "dram", 1 << 30, 1)
    hashes = _store_chain(run, 1, tokens(run_base(run), 3))
    run.place(1, "access", hashes[:2])
    dup = run.batch(1, "access", seq=run.streams[run.iid(1)].seq, entries=[])
    run.events(dup, kind="duplicate")
    stale = run.batch(1, "store", seq=1, incarnation=run.streams[run.iid(1)].incarnation - 5)
    run.events(stale, kind="stale")
    run.place(1, "delete", hashes[2:])
    nxt = run.streams[run.iid(1)].seq + 1  # refused bodies use no seq at either
    # at the last seq (LMCache drops it as a duplicate): the streams stay as one
    short = run.batch(
        1, "store", seq=nxt - 1, entries=[{"key": run.key("ab" * 16), "size_bytes": 1}]
    )
    run.events(short, kind="short-hash")
    for bad in (
        run.batch(1, "store", seq=nxt, tier="all"),
        run.batch(1, "store", seq=-1),
        run.batch(1, "store", seq=nxt, entries=[{"key": run.key("zz" * 32)}]),
        run.batch(1, "store", seq=nxt, entries=[{"key": run.key("ab" * 32), "size_bytes": -1}]),
        {"instance_id": run.iid(1), "seq": nxt},
    ):
        run.events(bad, kind="invalid")
    run.send("POST", "/events", {"batches": "x"}, kind="invalid")
    run.send("POST", "/events", {}, kind="valid")
    run.lookup_keys(hashes)
    # LMCache 0.5.7's servers stamp dropped_events on every batch (0.5.6's coordinator
    # skips it as an unknown field); a rise is a gap, counted, never refused.
    run.place(1, "access", hashes[:1])
    for dropped in (0, 3, 3, 1):
        run.events(run.batch(1, "access", dropped_events=dropped))
    run.events(run.batch(1, "access", dropped_events=-1), kind="invalid-dropped-events")
    run.events(run.batch(1, "access", dropped_events="x"), kind="invalid-dropped-events")
    run.events(run.batch(1, "access", future_field=[1, 2], dropped_events=5))
    run.lookup_keys(hashes)


@scenario("PUT /config/chunk-size", versions=("0.5.7rc2",))
def chunk_size(run: Run) -> None:
    """Binds at 256, both coordinators' minimum and the suite's CHUNK, so the other
    scenarios' hashing is unchanged whichever runs first (a binding lasts as long as the
    coordinators: ``test_chunk_size.py`` binds other sizes on pairs of its own)."""
    put = "PUT", "/config/chunk-size"
    run.send(*put, {"chunk_size": 128}, kind="chunk-size-conflict")  # below the minimum
    run.register(1, chunk_size=None)  # negotiation pending: nothing to bind
    run.register(2, chunk_size=CHUNK)  # binds (or the same, when bound already)
    run.send(*put, {"chunk_size": CHUNK})  # the same again: 200
    run.send(*put, {"chunk_size": CHUNK, "future_field": 1})  # unknown fields skipped
    run.send(*put, {"chunk_size": 2 * CHUNK}, kind="chunk-size-conflict")
    # a conflict registers nothing
    run.register(3, chunk_size=2 * CHUNK, kind="chunk-size-conflict")
    run.get("/instances")
    run.heartbeat(3)  # unknown at both
    for bad in ({"chunk_size": 0}, {"chunk_size": -1}, {"chunk_size": "x"}, {"chunk_size": 2.5}):
        run.send(*put, bad, kind="invalid")
    run.send(*put, {"chunk_size": None}, kind="invalid")
    run.send(*put, {}, kind="invalid")
    run.send(*put, b"{not json", kind="invalid")
    run.send(*put, kind="invalid")  # no body
    run.register(5, chunk_size=0, kind="invalid")
    run.register(5, chunk_size="x", kind="invalid")
    run.get("/instances")


def run_base(run: Run) -> int:
    """Token ids unique to this run, so no two runs share a chunk."""
    return int(run.tag, 16) % 1_000_000 * 4096


@scenario("GET /instances/usage", "GET /instances/{instance_id}/usage")
def usage(run: Run) -> None:
    run.register(1)
    run.register(2)
    run.config(1, "l1", "dram", 1 << 30, 1)
    run.config(1, "l2", "fs", 0, 1)
    run.config(2, "l2", "s3", 1 << 40, 1, shared=True)
    base = run_base(run)
    _store_chain(run, 1, tokens(base, 2))
    _store_chain(run, 1, tokens(base, 1), tier="l2", backend="fs")
    shared = _store_chain(run, 2, tokens(base + 50_000, 2), tier="l2", backend="s3", shared=True)
    run.register(3)
    run.place(3, "store", shared, tier="l2", backend="s3", shared=True)  # one pool, two reporters
    run.get("/instances/usage")
    run.get(f"/instances/{run.iid(1)}/usage")
    run.get(f"/instances/{run.iid(2)}/usage")
    run.get(f"/instances/{run.iid(8)}/usage", kind="unknown-id")
    run.deregister(1)  # L2 bytes outlive the process: still listed, unregistered
    run.get(f"/instances/{run.iid(1)}/usage")
    run.register(7)  # placements of no bytes
    run.place(7, "store", run.chain(tokens(base + 90_000, 1)), tier="l2", backend="fs", size=0)
    run.get(f"/instances/{run.iid(7)}/usage")
    run.deregister(7)
    run.get(f"/instances/{run.iid(7)}/usage")
    # a sender that never registered stores in L2, then leaves
    kept = _store_chain(run, 6, tokens(base + 80_000, 2), tier="l2", backend="fs")
    run.send("DELETE", f"/instances/{run.iid(6)}")
    gone = "after-unregistered-left"
    run.lookup_keys(kept, kind=gone)
    run.get(f"/instances/{run.iid(6)}/usage", kind=gone)
    run.get("/instances/usage", kind=gone)
    run.get(f"/directory/keys?instance_id={run.iid(6)}", kind=gone)
    run.place(6, "delete", kept, tier="l2", backend="fs")  # LMCache's go the same way


@scenario("POST /directory/lookup")
def lookup(run: Run) -> None:
    run.register(1)
    toks = tokens(run_base(run), 3)
    hashes = _store_chain(run, 1, toks)
    _store_chain(run, 1, toks[: 2 * CHUNK + 1], salt="t")
    run.place(1, "access", hashes[:1])
    run.lookup_tokens(toks)
    run.lookup_tokens(toks[:CHUNK])  # one full chunk, no extra token
    run.lookup_tokens(toks[:10])  # less than a chunk
    run.lookup_tokens(toks, salt="t")
    run.lookup_keys([*hashes, "00" * 32])
    run.lookup_keys(["cd" * 16], kind="short-hash")
    run.send(
        "POST",
        "/directory/lookup",
        {"keys": [run.key(hashes[0])], "token_ids": toks, "model_name": run.model},
        kind="invalid",
    )
    run.send("POST", "/directory/lookup", {}, kind="invalid")
    run.send("POST", "/directory/lookup", {"token_ids": toks}, kind="invalid")
    run.lookup_tokens(toks, model="", kind="invalid")


@scenario("GET /directory/keys", "GET /directory/stats")
def directory(run: Run) -> None:
    run.get("/directory/stats")
    run.register(1)
    run.register(2)
    base = run_base(run)
    h1 = _store_chain(run, 1, tokens(base, 2))
    _store_chain(run, 2, tokens(base, 3), tier="l2", backend="fs", shared=True)
    run.place(1, "access", h1)
    run.get("/directory/stats")
    run.get(f"/directory/keys?instance_id={run.iid(1)}")
    run.get(f"/directory/keys?instance_id={run.iid(2)}&tier=l2")
    run.get(f"/directory/keys?instance_id={run.iid(2)}&tier=l1")
    run.get(f"/directory/keys?instance_id={run.iid(1)}&backend=dram&limit=1")
    run.get(f"/directory/keys?instance_id={run.iid(2)}&offset=2&limit=5")
    run.get("/directory/keys?limit=0", kind="invalid")
    run.get("/directory/keys?offset=-1", kind="invalid")
    run.get("/directory/keys?tier=l3", kind="invalid")
    run.deregister(1)  # its L1 placements are fenced, its counts leave the stats
    run.get("/directory/stats")


@scenario("POST /directory/blend-lookup")
def blend(run: Run) -> None:
    packed = base64.b64encode(struct.pack("<4I", 1, 2, 3, 4)).decode()
    run.send("POST", "/directory/blend-lookup", {"tokens_b64": packed, "model_name": run.model})
    run.send(
        "POST", "/directory/blend-lookup", {"tokens_b64": "!!", "model_name": "m"}, kind="invalid"
    )


@scenario("GET /healthz")
def health(run: Run) -> None:
    run.get("/healthz")


@scenario("GET /metrics")
def metrics(run: Run) -> None:
    run.get("/metrics")


@scenario("PUT /quota/config", "GET /quota/config")
def quota_config(run: Run) -> None:
    run.get("/quota/config")
    run.quota_config(1.5)
    run.get("/quota/config")
    run.get("/quota/config?tier=l1", kind="invalid")
    run.quota_config(2.0, tier="l1", kind="invalid")
    run.quota_config(-1.0, kind="invalid")
    run.quota_config(None)
    run.get("/quota/config")


@scenario(
    "PUT /quota/{cache_salt}", "DELETE /quota/{cache_salt}", "GET /quota/{cache_salt}", "GET /quota"
)
def quotas(run: Run) -> None:
    a, b = run.salt(1), run.salt(2)
    run.register(1)
    _store_chain(run, 1, tokens(run_base(run), 2), salt=a, tier="l2", backend="fs")
    run.set_quota(a, 0.5)
    run.set_quota(b, 0)
    run.get(f"/quota/{a}")
    run.get(f"/quota/{a}?tier=l1")
    run.get(f"/quota/{b}")
    run.get(f"/quota/{run.salt(3)}")
    run.get("/quota")
    run.get("/quota?tier=l1")
    run.get("/quota?tier=all", kind="invalid")
    run.set_quota(a, -2, kind="invalid")
    run.set_quota(a, "x", kind="invalid")
    run.set_quota(a, 1, tier="l1", kind="invalid")
    run.delete_quota(b)
    run.delete_quota(b)  # not_found
    run.delete_quota(a, "?tier=l1")
    run.get("/quota")


@scenario("POST /cache/pins", "DELETE /cache/pins", "GET /cache/pins")
def pins(run: Run) -> None:
    base = run_base(run)
    toks = tokens(base, 3)
    run.pin(toks)
    run.pin(toks[: CHUNK + 1])
    run.pin(toks, salt="t")
    run.pin(toks[:10])  # no full chunk
    run.get(f"/cache/pins?model_name={run.model}")
    run.get(f"/cache/pins?model_name={run.model}&cache_salt=t")
    run.get(f"/cache/pins?model_name={run.model}&offset=1&limit=2")
    run.pin(toks, unpin=True)
    run.pin(toks, unpin=True)  # the second pin of the first chunk stays... and the rest
    run.get(f"/cache/pins?model_name={run.model}")
    run.pin(toks, kind="invalid", model="")
    run.send(
        "POST",
        "/cache/pins",
        {"model_name": run.model, "world_size": 0, "token_ids": toks},
        kind="invalid",
    )
    run.get("/cache/pins?limit=0", kind="invalid")


def target_instance(run: Run, target: Target) -> None:
    run.register(1, port=target.http_port)
    run.register(2, port=1)  # registered, but nothing listens there


def prefetch_scenario(run: Run, target: Target) -> None:
    target_instance(run, target)
    toks = tokens(run_base(run), 2)
    _ex, lm_rid, kv_rid = run.prefetch(1, toks)
    if lm_rid and kv_rid:
        run.poll(1, lm_rid, kv_rid)
        run.poll(1, lm_rid, kv_rid)  # dropped by the first completed poll: 404 at both
    run.prefetch(1, toks[:10])  # noop
    run.poll(1, "no-such-job", "no-such-job")
    run.prefetch(1, toks, model="not-on-this-node")  # the server: 503, both: 502
    run.prefetch(2, toks)  # unreachable
    run.prefetch(9, toks, kind="unknown-id")
    run.send("GET", f"/cache/prefetches/{run.iid(9)}/x", kind="unknown-id")
    run.send("POST", "/cache/prefetches", {"instance_id": run.iid(1)}, kind="invalid")


def delete_scenario(run: Run, target: Target) -> None:
    target_instance(run, target)
    toks = tokens(run_base(run), 2)
    # each coordinator's delete finds the chunks stored (stored again before each side)
    run.pair.send(
        run_call("POST", "/cache/delete", run, toks, "l1"), before=lambda: restore(target, toks)
    )
    run.delete(1, toks, tier="l1")  # gone: nothing affected
    run.delete(1, toks, tier="l1", force=True)
    run.delete(1, toks, tier="all")  # no L2 adapter on the server: it refuses, both 502
    run.delete(1, toks[:10])  # noop
    run.delete(2, toks)  # unreachable
    run.delete(9, toks, kind="unknown-id")
    run.delete(1, toks, tier="l4", kind="invalid")


def restore(target: Target, toks: list[int]) -> None:
    """Store ``toks`` on the server and wait until its lookup hits every chunk (a store
    is acknowledged before the server's L1 holds it) and its L1 commits them."""
    answer = target.engine.call("store", toks)
    assert answer["ok"], answer
    want = (len(toks) - 1) // CHUNK
    wait_until(
        lambda: target.engine.call("fetch", toks)["hit"],
        lambda hit: hit >= want,
        what="the server holds the chunks it stored",
        timeout=10,
    )
    # A lookup hits an object still being committed (a staging object, write-locked),
    # which a delete does not remove yet (seen on a loaded machine).
    wait_until(
        lambda: _l1_uncommitted(target),
        lambda counts: not any(counts.values()),
        what="the server's L1 commits every object",
        timeout=10,
    )


def _l1_uncommitted(target: Target) -> dict[str, int]:
    """The server's L1 objects a delete would skip: staging and write-locked ones."""
    r = httpx.get(f"{target.http_url}/status", timeout=5)
    r.raise_for_status()
    l1 = r.json()["storage_manager"]["l1_manager"]
    return {k: l1[k] for k in ("staging_object_count", "write_locked_count")}


def run_call(method: str, path: str, run: Run, toks: list[int], tier: str) -> Call:
    return Call(
        method,
        path,
        body(
            {
                "instance_id": run.iid(1),
                "model_name": Target.MODEL,
                "world_size": 1,
                "token_ids": toks,
                "cache_salt": "",
                "tier": tier,
            }
        ),
    )


TARGET_SCENARIOS: dict[str, Callable[[Run, Target], None]] = {
    "POST /cache/prefetches": prefetch_scenario,
    "GET /cache/prefetches/{instance_id}/{request_id}": prefetch_scenario,
    "POST /cache/delete": delete_scenario,
}
