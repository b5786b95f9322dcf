"""A kvatlas server's own cache-control routes (what a coordinator drives), on a real
``kvatlas server`` process without a coordinator: LMCache's shapes and status codes,
delete by key across tiers with leases honoured unless forced, listing, warm prefetch,
clear, per-salt usage, refusals, the token and the metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.connector.client import CacheClient
from kvatlas.wire.http_api import KeyWire
from support.cache_fleet import CHUNK, CHUNK_BYTES, L1_GB, MODEL, data, prompt
from support.services import ServerProc, start_server_process
from support.wait import wait_until

RANK1 = 16777472


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    s = start_server_process(
        tmp_path, "node-s",
        "--l1-size-gb", L1_GB, "--chunk-size", str(CHUNK),
        "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.05",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.tail()


@pytest.fixture
def engine(server: ServerProc) -> Iterator[CacheClient]:
    c = CacheClient(server.engine_url, timeout_s=10, engine_id="eng")
    c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
    yield c
    c.close()


def keys(c: CacheClient, tokens: list[int], salt: str = "") -> list[dict[str, Any]]:
    return [
        {"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": RANK1, "cache_salt": salt}
        for h in c.hashes(tokens)
    ]


def call(s: ServerProc, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, s.url + path, timeout=10, **kw)


def poll(s: ServerProc, request_id: str) -> dict[str, Any]:
    def status() -> dict[str, Any]:
        r = call(s, "GET", f"/cache/prefetches/{request_id}")
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    return wait_until(
        status, lambda job: job["status"] == "completed", what=f"prefetch {request_id} completed"
    )


def test_delete_by_key_per_tier_and_locks(server: ServerProc, engine: CacheClient) -> None:
    tokens = prompt(3, seed=1)
    assert engine.store_chunks(tokens, data(3, 1)).stored == 3
    ks = keys(engine, tokens)
    lease = engine.acquire(engine.hashes(tokens)[:1], lease_s=60)[0]
    assert lease is not None
    r = call(server, "DELETE", "/cache/objects", json={"keys": ks, "tier": "l1"})
    assert r.status_code == 200 and r.json() == {"deleted": 2, "skipped": 1, "ok": True}, r.text
    r = call(server, "DELETE", "/cache/objects", json={"keys": ks, "tier": "l1", "force": True})
    assert r.json() == {"deleted": 1, "skipped": 0, "ok": True}, r.text
    assert engine.lookup(tokens).hit_chunks == 0
    # Absent keys are no error (idempotent); the default tier is l2.
    r = call(server, "DELETE", "/cache/objects", json={"keys": ks})
    assert r.json() == {"deleted": 0, "skipped": 0, "ok": True}, r.text
    metrics = server.metrics()
    assert 'kvatlas_server_cache_deleted_keys_total{instance_id="node-s",tier="l1"} 3.0' in metrics
    assert 'kvatlas_server_cache_delete_skipped_locked_total{instance_id="node-s"} 1.0' in metrics
    status = server.status()["cache_control"]
    assert (status["deleted_l1"], status["skipped_locked"], status["delete_requests"]) == (3, 1, 3)


def test_l2_list_prefetch_and_delete(server: ServerProc, engine: CacheClient) -> None:
    tokens = prompt(3, seed=2)
    assert engine.store_chunks(tokens, data(3, 2)).stored == 3
    engine.store_chunks(prompt(16, seed=3), data(16, 3))  # demotes the first prompt to L2
    listed: list[dict[str, Any]] = []
    token = None
    while True:
        params: dict[str, Any] = {"page_size": 2, "model_name": MODEL}
        if token is not None:
            params["page_token"] = token
        r = call(server, "GET", "/cache/objects", params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["adapter"] == "disk" and page["shared"] is False
        assert len(page["entries"]) <= 2
        listed += page["entries"]
        token = page["next_page_token"]
        if token is None:
            break
    mine = {k["chunk_hash_hex"] for k in keys(engine, tokens)}
    in_l2 = {e["key"]["chunk_hash_hex"] for e in listed}
    assert mine <= in_l2 and all(e["size_bytes"] == CHUNK_BYTES for e in listed)
    # Warm them back into L1 (the answer is 202, as LMCache's).
    r = call(
        server,
        "POST",
        "/cache/prefetches",
        json={"model_name": MODEL, "world_size": 1, "token_ids": tokens},
    )
    assert r.status_code == 202, r.text
    sub = r.json()
    assert sub["status"] == "submitted" and sub["chunks"] == 3
    done = poll(server, sub["request_id"])
    assert (done["found_keys"], done["total_keys"]) == (3, 3)
    assert call(server, "GET", f"/cache/prefetches/{sub['request_id']}").status_code == 404
    # Now in both tiers: tier all removes both copies, counted per tier.
    r = call(server, "DELETE", "/cache/objects", json={"keys": keys(engine, tokens), "tier": "all"})
    assert r.json() == {"deleted": 6, "skipped": 0, "ok": True}, r.text
    assert 'source="l2"} 3.0' in server.metrics()
    status = server.status()["cache_control"]
    assert status["prefetches"] == {"submitted": 1, "completed": 1}
    assert status["prefetch_keys"] == {"l1": 0, "l2": 3, "peer": 0, "missing": 0}
    assert status["prefetch_jobs"] == 0


def test_per_salt_usage_and_clear(server: ServerProc, engine: CacheClient) -> None:
    tokens = prompt(2, seed=4)
    assert engine.store_chunks(tokens, data(2, 4)).stored == 2
    r = call(server, "GET", "/quota")
    assert r.status_code == 200, r.text
    row = r.json()["users"]["_default"]
    assert row["l1_usage_bytes"] == 2 * CHUNK_BYTES and row["exists"] is False
    r = call(server, "GET", "/quota/_default")
    assert r.json()["cache_salt"] == "_default" and r.json()["l1_usage_bytes"] == 2 * CHUNK_BYTES
    assert call(server, "GET", "/quota/tenant-x").json()["l1_usage_bytes"] == 0
    r = call(server, "PUT", "/quota/tenant-x", json={"limit_gb": 1})
    assert r.status_code == 501 and "coordinator" in r.json()["detail"]
    r = call(server, "POST", "/cache/clear")
    assert r.status_code == 200 and r.json() == {"status": "ok", "cleared": {"tier": "l1"}}
    assert engine.lookup(tokens).hit_chunks == 0
    assert server.status()["cache_control"]["deleted_l1"] == 2
    r = call(server, "POST", "/cache/clear", json={"tier": "l2"})
    assert r.status_code == 400 and "only 'l1'" in r.json()["detail"]


def test_prefetch_noop_and_refusals(server: ServerProc) -> None:
    base = {"model_name": MODEL, "world_size": 1}
    r = call(server, "POST", "/cache/prefetches", json={**base, "token_ids": [1, 2]})
    assert r.status_code == 202 and r.json() == {"chunks": 0, "status": "noop"}, r.text
    for over, status, needle in (
        ({"token_ids": [1], "source_tier": "l1"}, 400, "unsupported prefetch direction"),
        ({"token_ids": [1], "cache_salt": "a@b"}, 400, "cache_salt"),
        ({"token_ids": [1], "world_size": 0}, 422, "world_size"),
        ({"token_ids": "x"}, 422, "token_ids"),
    ):
        r = call(server, "POST", "/cache/prefetches", json={**base, **over})
        assert r.status_code == status and needle in r.json()["detail"], r.text
    r = call(server, "GET", "/cache/prefetches/nope")
    assert r.status_code == 404 and "unknown prefetch request_id" in r.json()["detail"]


def test_delete_refusals(server: ServerProc) -> None:
    good = KeyWire("ab" * 32, MODEL, RANK1)
    one = {"chunk_hash_hex": good.chunk_hash_hex, "model_name": MODEL, "kv_rank": RANK1}
    for payload, status, needle in (
        ({"keys": [one] * 10_001}, 400, "too many keys"),
        ({"keys": [{**one, "chunk_hash_hex": "zz"}]}, 400, "keys[0]"),
        ({"keys": [{**one, "cache_salt": "a/b"}]}, 400, "keys[0]: cache_salt"),
        ({"keys": [one], "adapter": "s3"}, 404, "no L2 adapter"),
        ({"keys": [one], "tier": "l9"}, 422, "tier"),
        ({"keys": "x"}, 422, "keys"),
    ):
        r = call(server, "DELETE", "/cache/objects", json=payload)
        assert r.status_code == status, (payload.get("tier"), r.text)
        assert needle in r.json()["detail"], r.text
    r = call(server, "GET", "/cache/objects", params={"tier": "l1"})
    assert r.status_code == 400 and "only 'l2'" in r.json()["detail"]
    r = call(server, "GET", "/cache/objects", params={"page_token": "x"})
    assert r.status_code == 400 and "page_token" in r.json()["detail"]
    r = call(server, "GET", "/cache/objects", params={"page_size": 0})
    assert r.status_code == 422


def test_checksum_refusals(server: ServerProc) -> None:
    """LMCache's ``/cache/checksums`` refusals (the digests themselves are compared with
    ``lmcache server``'s in tests/lmcache_mp)."""
    base = {"block_ids": [0, 1], "chunk_size": 2, "instance_id": 7}
    for over, status, needle in (
        ({"block_ids": []}, 400, "block_ids is required"),
        ({"chunk_size": 0}, 400, "chunk_size must be positive"),
        ({}, 404, "worker instance 7 registered no KV cache"),
        ({"block_ids": "x"}, 422, "block_ids"),
        ({"layerwise": 3}, 422, "layerwise"),
    ):
        r = call(server, "POST", "/cache/checksums", json={**base, **over})
        assert r.status_code == status and needle in r.json()["detail"], (over, r.text)


def test_checksums_need_the_lmcache_protocol(tmp_path: Path) -> None:
    s = start_server_process(
        tmp_path, "node-m", "--l1-size-gb", L1_GB, "--chunk-size", str(CHUNK),
        "--lmcache-mp", "off",
    )  # fmt: skip
    try:
        body = {"block_ids": [0], "chunk_size": 1, "instance_id": 1}
        r = call(s, "POST", "/cache/checksums", json=body)
        assert r.status_code == 501 and "--lmcache-mp off" in r.json()["detail"], r.text
    finally:
        assert s.stop() == 0, s.tail()


def test_without_l2_the_l2_routes_are_503(tmp_path: Path) -> None:
    s = start_server_process(tmp_path, "node-n", "--l1-size-gb", L1_GB, "--chunk-size", str(CHUNK))
    try:
        key = {"chunk_hash_hex": "ab" * 32, "model_name": MODEL, "kv_rank": RANK1}
        r = call(s, "DELETE", "/cache/objects", json={"keys": [key]})
        assert r.status_code == 503 and "no L2 adapters" in r.json()["detail"]
        r = call(s, "DELETE", "/cache/objects", json={"keys": [key], "tier": "l1"})
        assert r.status_code == 200, r.text
        assert call(s, "GET", "/cache/objects").status_code == 503
    finally:
        assert s.stop() == 0, s.tail()


def test_the_token_guards_every_route(tmp_path: Path) -> None:
    s = start_server_process(
        tmp_path, "node-t", "--l1-size-gb", L1_GB, "--chunk-size", str(CHUNK),
        "--auth-token", "secret",
    )  # fmt: skip
    try:
        for method, path in (
            ("GET", "/cache/objects"),
            ("DELETE", "/cache/objects"),
            ("POST", "/cache/prefetches"),
            ("GET", "/cache/prefetches/x"),
            ("POST", "/cache/clear"),
            ("POST", "/cache/checksums"),
            ("GET", "/quota"),
            ("GET", "/quota/_default"),
        ):
            r = call(s, method, path)
            assert r.status_code == 401, (method, path, r.text)
        ok = call(s, "GET", "/quota", headers={"Authorization": "Bearer secret"})
        assert ok.status_code == 200, ok.text
    finally:
        assert s.stop() == 0, s.tail()
