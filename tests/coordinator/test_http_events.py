"""`POST /events` against a real coordinator: both encodings (msgpack with and without key
blocks), the gate's outcomes, and bad bodies that must apply nothing."""

from __future__ import annotations

import msgspec

from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import Namespace
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.http_api import MSGPACK_CONTENT_TYPE
from support.coordinator import RunningCoordinator

from .events import (
    MODEL,
    RANK,
    batch,
    block_batch,
    fake_hash,
    json_body,
    key,
    msgpack_body,
    register_body,
)

JSON = {"content-type": "application/json"}
MSGPACK = {"content-type": MSGPACK_CONTENT_TYPE}


def stats(rc: RunningCoordinator) -> dict[str, object]:
    out: dict[str, object] = rc.client.get("/directory/stats").json()
    return out


def test_json_and_msgpack_ingest_with_gate_outcomes(coord: RunningCoordinator) -> None:
    c = coord.client
    c.post("/instances", json=register_body("node-a"))
    hs = [fake_hash(i) for i in range(256)]
    r = c.post("/events", content=json_body(batch("node-a", 1, hs[:128])), headers=JSON)
    assert r.json() == {
        "applied": 1,
        "duplicates": 0,
        "stale": 0,
        "gaps": 0,
        "missing_seqs": 0,
        "provisional": 0,
        "skipped": {},
    }
    r = c.post(
        "/events",
        content=msgpack_body(batch("node-a", 2, hs[128:]), batch("node-a", 2, hs)),
        headers=MSGPACK,
    )
    assert (r.json()["applied"], r.json()["duplicates"]) == (1, 1)
    r = c.post(
        "/events", content=msgpack_body(batch("node-a", 5, [fake_hash(999)])), headers=MSGPACK
    )
    assert (r.json()["gaps"], r.json()["missing_seqs"]) == (1, 2)
    r = c.post(
        "/events", content=json_body(batch("node-a", 6, hs[:1], incarnation=0)), headers=JSON
    )
    assert r.json()["stale"] == 1
    s = stats(coord)
    assert s["keys"] == 257
    assert s["cursors"] == [
        {"instance_id": "node-a", "incarnation": 1, "last_seq": 5, "gaps": 1, "missing": 2}
    ]
    # DELETE removes, ACCESS counts
    c.post(
        "/events",
        content=json_body(batch("node-a", 6, hs[:10], event=EventType.DELETE)),
        headers=JSON,
    )
    c.post(
        "/events",
        content=json_body(batch("node-a", 7, hs[10:11], event=EventType.ACCESS)),
        headers=JSON,
    )
    assert stats(coord)["keys"] == 247
    m = c.get("/metrics").text
    assert 'kvatlas_coordinator_ingest_batches_total{outcome="applied",transport="http"} 5.0' in m
    assert 'kvatlas_coordinator_ingest_batches_total{outcome="duplicate",transport="http"} 1.0' in m
    assert 'kvatlas_coordinator_ingest_entries_total{outcome="applied",transport="http"}' in m
    assert "kvatlas_coordinator_ingest_gaps_total 1.0" in m


def test_malformed_bodies_are_400_with_reason_and_apply_nothing(coord: RunningCoordinator) -> None:
    c = coord.client
    good = batch("node-a", 1, [fake_hash(1)])
    cases = [
        (b"not json", JSON),
        (b'{"batches": [{"instance_id": "x"}]}', JSON),
        (b"\xc1", MSGPACK),
        # a valid first batch and an invalid second one: nothing may apply
        (json_body(good, batch("", 2, [fake_hash(2)])), JSON),
        (json_body(good, batch("node-a", 2, [fake_hash(2)], size=1 << 41)), JSON),
        (msgpack_body(good, batch("node-a", 0, [fake_hash(2)])), MSGPACK),
    ]
    for body, headers in cases:
        r = c.post("/events", content=body, headers=headers)
        assert r.status_code == 400, (body[:40], r.text)
        assert r.json()["error"]
    bad_hash = msgspec.json.encode(
        {
            "batches": [
                {
                    "instance_id": "a",
                    "incarnation": 1,
                    "seq": 1,
                    "event_type": "store",
                    "tier": "l1",
                    "entries": [
                        {"key": {"chunk_hash_hex": "abc", "model_name": "m", "kv_rank": 1}}
                    ],
                }
            ]
        }
    )
    r = c.post("/events", content=bad_hash, headers=JSON)
    assert r.status_code == 400 and "64 hex" in r.json()["error"]
    assert stats(coord)["keys"] == 0
    assert stats(coord)["cursors"] == []


def test_json_body_without_batches_is_an_empty_list(coord: RunningCoordinator) -> None:
    """LMCache 0.5.6 defaults ``batches`` to []: ``{}`` is 200 and applies nothing. The
    msgpack form is kvatlas' own and still needs them."""
    c = coord.client
    r = c.post("/events", content=b"{}", headers=JSON)
    assert r.status_code == 200, r.text
    assert (r.json()["applied"], r.json()["duplicates"], r.json()["stale"]) == (0, 0, 0)
    r = c.post("/events", content=msgspec.msgpack.encode({}), headers=MSGPACK)
    assert r.status_code == 400 and "batches" in r.json()["error"]
    assert stats(coord)["cursors"] == []


def test_bad_token_ids_apply_nothing_with_blend(start_coordinator: object) -> None:
    rc: RunningCoordinator = start_coordinator(enable_blend_lookup=True, chunk_size=4)  # type: ignore[operator]
    good = batch("node-a", 1, [fake_hash(1)])
    bad = EventBatch(
        InstanceId("node-a"),
        Incarnation(1),
        2,
        EventType.STORE,
        Tier.L1,
        (Entry(key(fake_hash(2)), 10, (1, 2, 3, 2**33), 0),),
    )
    r = rc.client.post("/events", content=msgpack_body(good, bad), headers=MSGPACK)
    assert r.status_code == 400 and "token ids" in r.json()["error"]
    assert stats(rc)["keys"] == 0


def test_limits_are_413_with_reason(start_coordinator: object) -> None:
    rc: RunningCoordinator = start_coordinator(max_batch_entries=4, max_body_bytes=20000)  # type: ignore[operator]
    c = rc.client
    r = c.post(
        "/events",
        content=json_body(batch("node-a", 1, [fake_hash(i) for i in range(5)])),
        headers=JSON,
    )
    assert r.status_code == 413 and "the limit is 4" in r.json()["error"]
    r = c.post("/events", content=b"{" + b" " * 30000 + b"}", headers=JSON)
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunked() -> object:
        for _ in range(30):
            yield b" " * 1000

    r = c.post("/events", content=chunked(), headers=JSON)  # type: ignore[arg-type]
    assert r.status_code == 413
    assert stats(rc)["keys"] == 0


def lookup(rc: RunningCoordinator, hashes: list[bytes]) -> list[list[str]]:
    """Per hash, the instance ids holding it."""
    keys = [{"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": RANK} for h in hashes]
    r = rc.client.post("/directory/lookup", json={"keys": keys})
    assert r.status_code == 200, r.text
    return [sorted(p["instance_id"] for p in res["placements"]) for res in r.json()["results"]]


def test_msgpack_key_blocks_are_applied_like_entries(coord: RunningCoordinator) -> None:
    c = coord.client
    hs = [fake_hash(i) for i in range(300)]
    body = msgpack_body(
        block_batch("node-a", 1, hs[:256]),  # the emitters' form: all in one block
        block_batch("node-b", 1, hs[258:], head=(hs[256], hs[257])),  # entries, then block
        block_batch("node-a", 2, hs[:10], event=EventType.DELETE),
        block_batch("node-b", 2, hs[256:258], event=EventType.ACCESS),
    )
    r = c.post("/events", content=body, headers=MSGPACK)
    assert r.status_code == 200, r.text
    assert r.json()["applied"] == 4
    held = lookup(coord, hs)
    assert held[:10] == [[]] * 10
    assert held[10:256] == [["node-a"]] * 246
    assert held[256:] == [["node-b"]] * 44
    s = stats(coord)
    assert (s["keys"], s["placements"]) == (290, 290)
    m = c.get("/metrics").text
    applied = 'kvatlas_coordinator_ingest_entries_total{outcome="applied",transport="http"}'
    assert f"{applied} {256 + 44 + 10 + 2}.0" in m


def test_malformed_key_block_is_400_with_reason(coord: RunningCoordinator) -> None:
    c = coord.client
    good = block_batch("node-a", 1, [fake_hash(1)])
    ns = Namespace(MODEL, RANK)
    blob = fake_hash(2) + fake_hash(3)
    cases = [
        (KeyBlock(ns, blob[:-1], (1, 1)), "multiple of 32 bytes"),
        (KeyBlock(ns, blob, (1,)), "2 hashes but 1 sizes"),
        (KeyBlock(ns, blob, (1, 1 << 41)), "size_bytes must be in"),
        (KeyBlock(ns, blob, (-1, 1)), "got -1 in a key block"),
    ]
    for block, reason in cases:
        bad = EventBatch(
            InstanceId("node-a"), Incarnation(1), 2, EventType.STORE, Tier.L1, (), block=block
        )
        r = c.post("/events", content=msgpack_body(good, bad), headers=MSGPACK)
        assert r.status_code == 400, r.text
        assert reason in r.json()["error"] and "seq 2" in r.json()["error"]
    wrong_type = msgspec.msgpack.encode(
        {"batches": [{**msgspec.structs.asdict(good), "block": {"namespace": {}, "hashes": 1}}]}
    )
    r = c.post("/events", content=wrong_type, headers=MSGPACK)
    assert r.status_code == 400 and "block" in r.json()["error"]
    assert stats(coord)["keys"] == 0


def test_key_block_counts_toward_the_entries_limit(start_coordinator: object) -> None:
    rc: RunningCoordinator = start_coordinator(max_batch_entries=4)  # type: ignore[operator]
    hs = [fake_hash(i) for i in range(5)]
    r = rc.client.post(
        "/events",
        content=msgpack_body(block_batch("node-a", 1, hs[2:], head=tuple(hs[:2]))),
        headers=MSGPACK,
    )
    assert r.status_code == 413 and "has 5 entries" in r.json()["error"]
    assert stats(rc)["keys"] == 0
