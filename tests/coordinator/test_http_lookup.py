"""Directory reads against a real coordinator: token and key lookups, blend lookups,
stats, key listing, auth, OpenAPI and metrics."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from kvatlas.core.events import Entry
from kvatlas.core.keys import CHAINS, DEFAULT_CHAIN_NAME, pack_kv_rank
from kvatlas.core.types import Tier
from kvatlas.wire.directory_api import LookupRequest, encode_lookup_msgpack
from kvatlas.wire.json_tokens import DEFAULT_PARSER_NAME, PARSERS
from support.coordinator import RunningCoordinator

from .events import (
    MODEL,
    batch,
    block_batch,
    fake_hash,
    json_body,
    msgpack_body,
    prompt_hashes,
    register_body,
)

JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": "application/msgpack"}


def test_tokens_lookup_reports_chunks_and_prefix_holders(coord: RunningCoordinator) -> None:
    c = coord.client
    tokens = list(range(1000, 1000 + 256 * 4 + 17))
    hs = prompt_hashes(tokens)
    assert len(hs) == 4
    c.post("/instances", json=register_body("node-a"))
    c.post("/instances", json=register_body("node-b"))
    c.post(
        "/events",
        content=json_body(
            batch("node-a", 1, hs[:3]),
            batch("node-b", 1, hs[:1]),
            batch("node-b", 2, hs[3:], tier=Tier.L2),
        ),
        headers=JSON,
    )
    r = c.post("/directory/lookup", json={"token_ids": tokens, "model_name": MODEL})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["chunks"] == 4
    assert [res["key"]["chunk_hash_hex"] for res in body["results"]] == [h.hex() for h in hs]
    assert body["results"][0]["key"]["kv_rank"] == 16777472
    assert sorted(p["instance_id"] for p in body["results"][0]["placements"]) == [
        "node-a",
        "node-b",
    ]
    assert body["results"][3]["placements"][0]["tier"] == "l2"
    holders = {
        (h["instance_id"], h["tier"]): (h["chunks"], h["tokens"]) for h in body["prefix_holders"]
    }
    assert holders[("node-a", "l1")] == (3, 768)
    assert holders[("node-b", "l1")] == (1, 256)
    # another namespace (world size 2, salt) does not see these keys
    for extra in ({"world_size": 2}, {"cache_salt": "s"}, {"model_name": "other"}):
        r = c.post("/directory/lookup", json={"token_ids": tokens, "model_name": MODEL, **extra})
        assert all(not res["placements"] for res in r.json()["results"])
    r = c.post(
        "/directory/lookup",
        json={"token_ids": tokens, "model_name": MODEL, "kv_rank": pack_kv_rank(1, 0, 1, 0)},
    )
    assert r.json()["results"][0]["placements"]


def test_keys_lookup_and_bad_requests(coord: RunningCoordinator) -> None:
    c = coord.client
    h = fake_hash(3)
    c.post("/events", content=json_body(batch("node-a", 1, [h])), headers=JSON)
    key = {"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": 16777472}
    missing = {**key, "chunk_hash_hex": fake_hash(4).hex()}
    r = c.post("/directory/lookup", json={"keys": [key, missing]})
    res = r.json()["results"]
    assert len(res[0]["placements"]) == 1 and res[1]["placements"] == []
    for bad in (
        {},
        {"keys": [key], "token_ids": [1]},
        {"token_ids": [1, 2]},
        {"token_ids": [-1], "model_name": "m"},
        {"keys": [{**key, "chunk_hash_hex": "zz"}]},
        {"token_ids": "x", "model_name": "m"},
    ):
        r = c.post("/directory/lookup", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]


def test_every_lookup_form_gives_the_same_answer(coord: RunningCoordinator) -> None:
    """token_ids, tokens_b64, the msgpack body (raw tokens) and the keys form (one
    namespace: fast path; mixed namespaces or upper-case hex: per-key path) agree."""
    c = coord.client
    tokens = list(range(500, 500 + 256 * 6))
    hs = prompt_hashes(tokens)
    c.post("/events", content=msgpack_body(batch("node-a", 1, hs[:4])), headers=MSGPACK)
    c.post(
        "/events", content=msgpack_body(batch("node-b", 1, hs[:2], tier=Tier.L2)), headers=MSGPACK
    )
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    by_ids = c.post("/directory/lookup", json={"token_ids": tokens, "model_name": MODEL})
    by_b64 = c.post(
        "/directory/lookup",
        json={"tokens_b64": base64.b64encode(raw).decode(), "model_name": MODEL},
    )
    by_msgpack = c.post(
        "/directory/lookup",
        content=encode_lookup_msgpack(LookupRequest(tokens_b64=raw, model_name=MODEL)),
        headers=MSGPACK,
    )
    assert by_ids.status_code == by_b64.status_code == by_msgpack.status_code == 200
    assert by_ids.content == by_b64.content == by_msgpack.content
    answer = by_ids.json()
    assert [len(r["placements"]) for r in answer["results"]] == [2, 2, 1, 1, 0, 0]
    keys: list[dict[str, Any]] = [
        {"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": 16777472} for h in hs
    ]
    by_keys = c.post("/directory/lookup", json={"keys": keys}).json()
    assert by_keys["results"] == answer["results"]
    assert by_keys["prefix_holders"] == []
    upper = [{**k, "chunk_hash_hex": k["chunk_hash_hex"].upper()} for k in keys]
    echoed = c.post("/directory/lookup", json={"keys": upper}).json()["results"]
    assert [r["key"]["chunk_hash_hex"] for r in echoed] == [k["chunk_hash_hex"] for k in upper]
    assert [r["placements"] for r in echoed] == [r["placements"] for r in answer["results"]]
    other = {**keys[0], "model_name": "other"}
    mixed = c.post("/directory/lookup", json={"keys": [*keys, other]}).json()["results"]
    assert mixed[:-1] == answer["results"]
    assert mixed[-1]["placements"] == []
    r = c.post("/directory/lookup", content=b"\xc1", headers=MSGPACK)
    assert r.status_code == 400 and "malformed" in r.json()["error"]
    bad_hex = [{**keys[0], "chunk_hash_hex": "g" * 64}]
    r = c.post("/directory/lookup", json={"keys": bad_hex})
    assert r.status_code == 400 and "not hex" in r.json()["error"]


def test_lookup_limits(start_coordinator: object) -> None:
    rc: RunningCoordinator = start_coordinator(max_lookup_tokens=1000, max_lookup_keys=2)  # type: ignore[operator]
    r = rc.client.post("/directory/lookup", json={"token_ids": [1] * 1001, "model_name": "m"})
    assert r.status_code == 413 and "limit of 1000" in r.json()["error"]
    key = {"chunk_hash_hex": "00" * 32, "model_name": "m", "kv_rank": 1}
    r = rc.client.post("/directory/lookup", json={"keys": [key] * 3})
    assert r.status_code == 413


def test_blend_lookup(start_coordinator: object) -> None:
    rc: RunningCoordinator = start_coordinator(enable_blend_lookup=True, chunk_size=4)  # type: ignore[operator]
    c = rc.client
    doc = [11, 12, 13, 14, 15, 16, 17, 18]
    hs = prompt_hashes(doc, 4)
    stored = batch("node-a", 1, hs)

    entries = tuple(
        Entry(e.key, e.size_bytes, tuple(doc[4 * i : 4 * i + 4]), 4 * i)
        for i, e in enumerate(stored.entries)
    )

    stored = msgspec.structs.replace(stored, entries=entries)
    assert c.post("/events", content=msgpack_body(stored), headers=MSGPACK).json()["applied"] == 1
    query = [1, 2, 3, 15, 16, 17, 18, 9, 11, 12, 13, 14]
    b64 = base64.b64encode(np.array(query, dtype="<u4").tobytes()).decode()
    r = c.post("/directory/blend-lookup", json={"tokens_b64": b64, "model_name": MODEL})
    assert r.status_code == 200, r.text
    assert r.json()["matches"] == [
        {"chunk_hash": hs[1].hex(), "old_st": 4, "cur_st": 3},
        {"chunk_hash": hs[0].hex(), "old_st": 0, "cur_st": 8},
    ]
    assert c.get("/directory/stats").json()["blend"]["chunks"] == 2
    # tokens come back with lookups when blend keeps them
    r = c.post("/directory/lookup", json={"token_ids": doc, "model_name": MODEL})
    assert r.json()["results"][1]["token_ids"] == doc[4:]
    for bad in (
        {"tokens_b64": "!!", "model_name": MODEL},
        {"tokens_b64": "AAA=", "model_name": MODEL},
        {"tokens_b64": b64, "model_name": ""},
    ):
        assert c.post("/directory/blend-lookup", json=bad).status_code == 400


def test_blend_lookup_disabled_is_404_with_reason(coord: RunningCoordinator) -> None:
    r = coord.client.post("/directory/blend-lookup", json={"tokens_b64": "", "model_name": "m"})
    assert r.status_code == 404 and "--enable-blend-lookup" in r.json()["error"]


def test_keys_listing_paginates_and_filters(coord: RunningCoordinator) -> None:
    c = coord.client
    c.post(
        "/events",
        content=json_body(
            batch("node-a", 1, [fake_hash(i) for i in range(5)]),
            batch(
                "node-b",
                1,
                [fake_hash(i) for i in range(3)],
                tier=Tier.L2,
            ),
        ),
        headers=JSON,
    )
    page = c.get("/directory/keys", params={"limit": 2}).json()
    assert len(page["keys"]) == 2 and page["next_offset"] == 2
    assert len(page["keys"][0]["chunk_hash_prefix_hex"]) == 16
    assert "8-byte" in page["note"]
    seen = []
    offset: int | None = 0
    while offset is not None:
        page = c.get("/directory/keys", params={"offset": offset, "limit": 2}).json()
        seen += [k["chunk_hash_prefix_hex"] for k in page["keys"]]
        offset = page["next_offset"]
    assert sorted(seen) == sorted(fake_hash(i)[:8].hex() for i in range(5))
    assert len(c.get("/directory/keys", params={"tier": "l2"}).json()["keys"]) == 3
    l2 = c.get("/directory/keys", params={"tier": "l2", "instance": "node-a"}).json()
    assert l2["keys"] == []
    assert (
        len(
            c.get("/directory/keys", params={"backend": "cpu", "instance": "node-b"}).json()["keys"]
        )
        == 3
    )
    for bad in ({"tier": "l3"}, {"limit": 0}, {"offset": -1}, {"limit": "x"}):
        assert c.get("/directory/keys", params=bad).status_code == 400


def test_filtered_listing_pages_across_scan_steps(coord: RunningCoordinator) -> None:
    """A filtered listing walks the directory in steps (the lock is released between
    them); pages that straddle steps must still add up to exactly the matching keys."""
    c = coord.client
    n = 5000  # more than two scan steps
    every = [fake_hash(i, salt=9) for i in range(n)]
    sparse = every[::7]  # node-b holds one key in seven, spread over every step
    c.post("/events", content=msgpack_body(block_batch("node-a", 1, every)), headers=MSGPACK)
    c.post("/events", content=msgpack_body(block_batch("node-b", 1, sparse)), headers=MSGPACK)
    for params, expected in (({"instance": "node-b"}, sparse), ({}, every)):
        seen: list[str] = []
        offset: int | None = 0
        while offset is not None:
            page = c.get("/directory/keys", params={**params, "offset": offset, "limit": 300})
            body = page.json()
            seen += [k["chunk_hash_prefix_hex"] for k in body["keys"]]
            offset = body["next_offset"]
        assert seen == [h[:8].hex() for h in expected]


def test_stats_shape_and_digest(coord: RunningCoordinator) -> None:
    c = coord.client
    c.post(
        "/events",
        content=json_body(
            batch("node-a", 1, [fake_hash(1)], size=100),
            batch("node-a", 2, [fake_hash(2)], size=50, tier=Tier.L2),
        ),
        headers=JSON,
    )
    s = c.get("/directory/stats", params={"digest": "1"}).json()
    assert s["keys"] == 2 and s["placements"] == 2
    assert s["bytes_by_tier"] == {"l1": 100, "l2": 50}
    assert {o["tier"] for o in s["owners"]} == {"l1", "l2"}
    assert len(s["digest"]) == 64
    assert c.get("/directory/stats").json()["digest"] is None


def test_auth_token_guards_everything_but_healthz(start_coordinator: object) -> None:

    rc: RunningCoordinator = start_coordinator(auth_token="s3cret")  # type: ignore[operator]
    with httpx.Client(base_url=rc.url) as anon:
        assert anon.get("/healthz").status_code == 200
        for method, path in (
            ("GET", "/instances"),
            ("POST", "/instances"),
            ("POST", "/events"),
            ("GET", "/metrics"),
            ("GET", "/readyz"),
            ("GET", "/openapi.json"),
            ("POST", "/directory/lookup"),
            ("GET", "/directory/stats"),
            ("PUT", "/instances/a/heartbeat"),
            ("DELETE", "/instances/a"),
        ):
            r = anon.request(method, path)
            assert r.status_code == 401, path
            assert "bearer" in r.json()["error"]
        r = anon.get("/instances", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        for value in ("Bearer é".encode(), "Bearer é".encode("latin-1"), b"\xff\xfe"):
            r = anon.get("/instances", headers={b"Authorization": value})
            assert r.status_code == 401, value
    assert rc.client.get("/instances").status_code == 200
    assert rc.client.post("/instances", json=register_body("a")).status_code == 200


def test_openapi_describes_every_route(coord: RunningCoordinator) -> None:
    doc = coord.client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    routes = {(r.path, r.method.lower()) for r in coord.coordinator.http.router.routes()}
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented
    assert "RegisterRequest" in doc["components"]["schemas"]


def test_readyz_and_healthz(coord: RunningCoordinator) -> None:
    assert coord.client.get("/healthz").content == b'{"status":"healthy"}'  # LMCache's
    assert coord.client.get("/readyz").json() == {"ready": True, "reason": ""}


def server_timing(value: str) -> dict[str, float]:
    """``a;dur=1.5, b;dur=2`` -> {"a": 1.5, "b": 2.0}."""
    out = {}
    for metric in value.split(","):
        name, _, dur = metric.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def test_keys_lookup_says_its_steps(coord: RunningCoordinator) -> None:
    """The keys form has no hashing step: it says 0 for it."""
    key = {"chunk_hash_hex": "ab" * 32, "model_name": MODEL, "kv_rank": 16777472}
    r = coord.client.post("/directory/lookup", json={"keys": [key]})
    assert r.status_code == 200, r.text
    timing = server_timing(r.headers["server-timing"])
    assert list(timing) == ["recv", "decode", "hash", "probe", "encode", "gc", "app"]
    assert timing["hash"] == 0


def test_json_token_ids_answer_as_tokens_b64_and_say_their_time(coord: RunningCoordinator) -> None:
    """The JSON array (read by the fast path, in any spacing) and the base64 form of the
    same prompt get the same answer; every lookup says its server-side time, step by
    step (the steps, the collector's pauses included, add up to no more than it)."""

    c = coord.client
    tokens = list(range(900, 900 + 4 * 256 + 3))
    c.post("/instances", json=register_body("node-a"))
    c.post(
        "/events", content=json_body(batch("node-a", 1, prompt_hashes(tokens)[:3])), headers=JSON
    )
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    answers = []
    for body in (
        json.dumps({"token_ids": tokens, "model_name": MODEL}),
        json.dumps({"model_name": MODEL, "token_ids": tokens}, indent=1),
        json.dumps({"tokens_b64": base64.b64encode(raw).decode(), "model_name": MODEL}),
    ):
        r = c.post("/directory/lookup", content=body.encode(), headers=JSON)
        assert r.status_code == 200, r.text
        timing = server_timing(r.headers["server-timing"])
        assert list(timing) == ["recv", "decode", "hash", "probe", "encode", "gc", "app"]
        assert min(timing.values()) >= 0
        steps = sum(timing[s] for s in ("decode", "hash", "probe", "encode"))
        assert steps <= timing["app"] + 0.005 and timing["gc"] <= timing["app"] + 0.001
        answers.append(r.json())
    assert answers[0] == answers[1] == answers[2]
    assert [len(x["placements"]) for x in answers[0]["results"]] == [1, 1, 1, 0]


def test_metrics_say_which_json_token_parser_reads_lookups(coord: RunningCoordinator) -> None:
    """The compiled parser where the C extension was built, numpy's where it was not."""
    text = coord.client.get("/metrics").text
    assert f'kvatlas_coordinator_json_token_parser{{parser="{DEFAULT_PARSER_NAME}"}} 1.0' in text
    assert DEFAULT_PARSER_NAME in PARSERS


def test_metrics_say_which_chain_hashes_lookups(coord: RunningCoordinator) -> None:
    """The compiled chain where the BLAKE3 C sources were found, Python's where not."""
    text = coord.client.get("/metrics").text
    assert f'kvatlas_coordinator_token_chain{{chain="{DEFAULT_CHAIN_NAME}"}} 1.0' in text
    assert DEFAULT_CHAIN_NAME in CHAINS


def _memo_metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_prompt_asked_again_is_hashed_from_the_memo(
    start_coordinator: Callable[..., RunningCoordinator],
) -> None:
    """Answers stay the same whether the links come from the memo or not; the memo's
    metrics say which (admitted on the second lookup, found from the third)."""
    if "compiled" not in CHAINS:
        pytest.skip("the memo serves the compiled chain, not built here")
    with_memo = start_coordinator()
    without = start_coordinator(token_hash_memo_bytes=0)
    tokens = list(range(500, 500 + 256 * 6 + 3))
    hs = prompt_hashes(tokens)
    answers = []
    for rc in (with_memo, without):
        rc.client.post("/instances", json=register_body("node-a"))
        rc.client.post("/events", content=json_body(batch("node-a", 1, hs[:4])), headers=JSON)
        for _ in range(3):
            r = rc.client.post("/directory/lookup", json={"token_ids": tokens, "model_name": MODEL})
            assert r.status_code == 200, r.text
            answers.append(r.json())
    assert all(a == answers[0] for a in answers)
    assert [len(res["placements"]) for res in answers[0]["results"]] == [1] * 4 + [0] * 2
    text = with_memo.client.get("/metrics").text
    hit = 'kvatlas_coordinator_token_hash_memo_links_total{result="hit"}'
    miss = 'kvatlas_coordinator_token_hash_memo_links_total{result="miss"}'
    assert (_memo_metric(text, hit), _memo_metric(text, miss)) == (6.0, 12.0)
    assert (_memo_metric(text, "kvatlas_coordinator_token_hash_memo_bytes") or 0) > 0
    assert _memo_metric(without.client.get("/metrics").text, hit) is None
