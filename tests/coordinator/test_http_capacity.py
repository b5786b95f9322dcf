"""`config` batches and the forward-compatibility rule of `POST /events`, against a real
coordinator over HTTP, in LMCache's shapes: declarations in `/directory/stats`, in
`GET /instances/usage` (LMCache's shape) and in the metrics; fenced and forgotten with
their instance; unknown event types skipped, counted and still moving the gate; a
malformed known batch failing the whole body."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.coordinator import RunningCoordinator

from .events import MODEL, fake_hash, prompt_hashes, register_body
from .lmcache_shapes import (
    INCARNATION,
    config_batch,
    events_body,
    lmcache_batch,
    lmcache_key,
    store_batch,
)

JSON = {"content-type": "application/json"}
GIB = 1 << 30


def post(rc: RunningCoordinator, *batches: dict[str, Any]) -> Any:
    return rc.client.post("/events", content=events_body(*batches), headers=JSON)


def cursor(rc: RunningCoordinator, iid: str) -> dict[str, Any]:
    [c] = [
        c for c in rc.client.get("/directory/stats").json()["cursors"] if c["instance_id"] == iid
    ]
    out: dict[str, Any] = c
    return out


def test_config_batches_are_kept_and_served_in_lmcaches_usage_shape(
    coord: RunningCoordinator,
) -> None:
    c = coord.client
    c.post("/instances", json=register_body("mp-1", incarnation=INCARNATION))
    c.post("/instances", json=register_body("mp-2", incarnation=INCARNATION))
    r = post(
        coord,
        config_batch("mp-1", 1, "l1", "dram", 4 * GIB, 1),
        config_batch("mp-1", 2, "l2", "fs", 0, 1),  # 0: no limit declared
        config_batch("mp-1", 3, "l2", "s3", 100 * GIB, 1, shared=True),
        store_batch("mp-1", 4, [fake_hash(i) for i in range(4)], GIB // 2),
        store_batch("mp-1", 5, [fake_hash(9)], 1000, tier="l2", backend="fs"),
        store_batch("mp-1", 6, [fake_hash(8)], 2000, tier="l2", backend="s3", shared=True),
    )
    assert r.status_code == 200, r.text
    assert (r.json()["applied"], r.json()["gaps"]) == (6, 0)
    usage = c.get("/instances/usage").json()
    assert usage == {
        "instances": [
            {
                "instance_id": "mp-1",
                "registered": True,
                "declared_capacity": True,
                "modules": [
                    {
                        "tier": "l1",
                        "backend": "dram",
                        "shared": False,
                        "used_bytes": 2 * GIB,
                        "capacity_bytes": 4 * GIB,
                        "usage_ratio": 0.5,
                    },
                    {
                        "tier": "l2",
                        "backend": "fs",
                        "shared": False,
                        "used_bytes": 1000,
                        "capacity_bytes": 0,
                        "usage_ratio": None,
                    },
                ],
            },
            {"instance_id": "mp-2", "registered": True, "declared_capacity": False, "modules": []},
        ],
        "shared_modules": [
            {
                "tier": "l2",
                "backend": "s3",
                "shared": True,
                "used_bytes": 2000,
                "capacity_bytes": 100 * GIB,
                "usage_ratio": 2000 / (100 * GIB),
            }
        ],
    }
    assert c.get("/instances/mp-2/usage").json()["declared_capacity"] is False
    assert c.get("/instances/nobody/usage").status_code == 404
    [decl] = c.get("/directory/stats").json()["capacity"]
    assert (decl["instance_id"], decl["incarnation"], decl["revision"]) == ("mp-1", INCARNATION, 1)
    assert [(m["tier"], m["backend"]) for m in decl["compartments"]] == [
        ("l1", "dram"),
        ("l2", "fs"),
        ("l2", "s3"),
    ]
    m = c.get("/metrics").text
    assert 'kvatlas_coordinator_config_batches_total{transport="http"} 3.0' in m
    assert (
        'kvatlas_coordinator_declared_capacity_bytes{backend="dram",instance_id="mp-1",tier="l1"}'
        " 4.294967296e+09" in m
    )
    # a new revision replaces the declaration; a straggler of the old one is dropped
    post(coord, config_batch("mp-1", 7, "l1", "dram", 8 * GIB, 2))
    post(coord, config_batch("mp-1", 8, "l2", "fs", 5, 1))
    [decl] = c.get("/directory/stats").json()["capacity"]
    assert [(m["backend"], m["capacity_bytes"]) for m in decl["compartments"]] == [
        ("dram", 8 * GIB)
    ]
    # a restarted process (higher incarnation in its events) fences the old declaration
    post(coord, store_batch("mp-1", 1, [fake_hash(20)], 10, incarnation=INCARNATION + 5))
    assert c.get("/directory/stats").json()["capacity"] == []
    post(coord, config_batch("mp-1", 2, "l1", "dram", GIB, 1, incarnation=INCARNATION + 5))
    assert c.get("/instances/mp-1/usage").json()["modules"][0]["capacity_bytes"] == GIB
    # deregistration forgets it; L2 bytes that survive keep the instance in the view
    assert c.delete("/instances/mp-1").status_code == 204
    gone = c.get("/instances/mp-1/usage").json()
    assert (gone["registered"], gone["declared_capacity"]) == (False, False)
    assert [(m["tier"], m["used_bytes"]) for m in gone["modules"]] == [("l2", 1000)]


def test_zero_byte_placements_list_no_module(coord: RunningCoordinator) -> None:
    """LMCache's usage book drops a rollup at 0 bytes: an instance held only by 0-byte
    placements is unknown (404), a registered one lists no module, nor does a pool."""
    c = coord.client
    c.post("/instances", json=register_body("mp-2", incarnation=INCARNATION))
    r = post(
        coord,
        store_batch("mp-1", 1, [fake_hash(1), fake_hash(2)], 0),
        store_batch("mp-2", 1, [fake_hash(3)], 0, tier="l2", backend="fs"),
        store_batch("mp-2", 2, [fake_hash(4)], 0, tier="l2", backend="s3", shared=True),
    )
    assert r.status_code == 200 and r.json()["applied"] == 3, r.text
    assert c.get("/instances/usage").json() == {
        "instances": [
            {"instance_id": "mp-2", "registered": True, "declared_capacity": False, "modules": []}
        ],
        "shared_modules": [],
    }
    assert c.get("/instances/mp-1/usage").status_code == 404
    assert c.get("/instances/mp-2/usage").json()["modules"] == []


def test_unknown_event_types_are_skipped_counted_and_move_the_gate(
    coord: RunningCoordinator,
) -> None:
    c = coord.client
    c.post("/instances", json=register_body("mp-1", incarnation=INCARNATION))
    future = {"instance_id": "mp-1", "incarnation": INCARNATION, "seq": 2, "event_type": "pin"}
    future["pins"] = [{"anything": "a newer sender sends"}]
    r = post(
        coord,
        store_batch("mp-1", 1, [fake_hash(1)], 10),
        future,
        lmcache_batch("mp-1", 3, "hint", tier="l9"),
        {**future, "seq": 4},
        store_batch("mp-1", 5, [fake_hash(2)], 10),
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["applied"], out["gaps"], out["skipped"]) == (2, 0, {"pin": 2, "hint": 1})
    assert cursor(coord, "mp-1")["last_seq"] == 5
    # a resent unknown batch is a duplicate like any other
    r = post(coord, {**future, "seq": 4}, store_batch("mp-1", 6, [fake_hash(3)], 10))
    assert (r.json()["duplicates"], r.json()["applied"], r.json()["gaps"]) == (1, 1, 0)
    assert c.get("/directory/stats").json()["keys"] == 3
    m = c.get("/metrics").text
    assert 'kvatlas_coordinator_skipped_batches_total{event_type="pin",transport="http"} 2.0' in m
    assert 'kvatlas_coordinator_ingest_batches_total{outcome="skipped",transport="http"} 3.0' in m


def test_a_malformed_known_batch_fails_the_body_and_applies_nothing(
    coord: RunningCoordinator,
) -> None:
    c = coord.client
    c.post("/instances", json=register_body("mp-1", incarnation=INCARNATION))
    future = {"instance_id": "mp-1", "incarnation": INCARNATION, "seq": 2, "event_type": "pin"}
    bad_bodies = [
        (store_batch("mp-1", 3, [fake_hash(1)], 10, tier="l3"), "batches[2].tier"),
        (config_batch("mp-1", 3, "l1", "", GIB, 1), "must name its backend"),
        ({**store_batch("mp-1", 3, [fake_hash(1)], 10), "seq": "three"}, "batches[2].seq"),
    ]
    for bad, reason in bad_bodies:
        r = post(coord, store_batch("mp-1", 1, [fake_hash(0)], 10), future, bad)
        assert r.status_code == 400 and reason in r.json()["error"], r.text
    s = c.get("/directory/stats").json()
    assert (s["keys"], s["cursors"], s["capacity"]) == (0, [], [])
    assert 'ingest_batches_total{outcome="invalid",transport="http"} 3.0' in c.get("/metrics").text


def test_declarations_survive_a_snapshot_restore(start_coordinator: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "fleet.snap")
    rc: RunningCoordinator = start_coordinator(snapshot_path=path)
    rc.client.post("/instances", json=register_body("mp-1", incarnation=INCARNATION))
    post(rc, config_batch("mp-1", 1, "l1", "dram", 4 * GIB, 3))
    before = rc.client.get("/instances/usage").json()
    rc.stop()
    rc2: RunningCoordinator = start_coordinator(snapshot_path=path)
    assert rc2.client.get("/instances/usage").json() == before
    # the stamp came back too: a straggler of an older revision is still dropped
    post(rc2, config_batch("mp-1", 2, "l1", "dram", GIB, 2))
    assert rc2.client.get("/instances/usage").json() == before


def test_the_rule_is_in_the_openapi_document(coord: RunningCoordinator) -> None:
    doc = coord.client.get("/openapi.json").json()
    rule = doc["paths"]["/events"]["post"]["description"]
    for words in ("does not know", "still advances its sender's gate cursor", "nothing of the"):
        assert words in rule
    schemas = doc["components"]["schemas"]
    assert "config" in schemas["BatchWire"]["properties"]["event_type"]["enum"]
    assert "skipped" in schemas["EventsResponse"]["properties"]
    assert "usage_ratio" in schemas["ModuleUsageWire"]["properties"]


def test_token_ids_are_kept_by_default_and_their_bytes_reported(
    start_coordinator: Any, tmp_path: Path
) -> None:
    """LMCache's servers send each chunk's token ids with STORE and its coordinator
    returns them in lookups; kvatlas does so with no flag. `--drop-token-ids` drops them."""
    tokens = list(range(500, 500 + 2 * 256))
    hashes = list(prompt_hashes(tokens))
    chunks = [tokens[:256], tokens[256:]]

    def stored(rc: RunningCoordinator) -> Any:
        entries = [
            {"key": lmcache_key(h), "size_bytes": 10, "token_ids": t, "token_offset": 256 * i}
            for i, (h, t) in enumerate(zip(hashes, chunks, strict=True))
        ]
        post(rc, lmcache_batch("mp-1", 1, "store", entries=entries))
        body = {"token_ids": tokens, "model_name": MODEL, "world_size": 1}
        return rc.client.post("/directory/lookup", json=body).json()

    path = str(tmp_path / "fleet.snap")
    rc: RunningCoordinator = start_coordinator(snapshot_path=path)
    assert [r["token_ids"] for r in stored(rc)["results"]] == chunks
    assert rc.client.get("/directory/stats").json()["token_ids"] == {"keys": 2, "bytes": 2048}
    assert "kvatlas_coordinator_directory_token_bytes 2048.0" in rc.client.get("/metrics").text
    rc.stop()
    again: RunningCoordinator = start_coordinator(snapshot_path=path)  # kept in the snapshot
    assert again.client.get("/directory/stats").json()["token_ids"] == {"keys": 2, "bytes": 2048}
    again.stop()
    dropped: RunningCoordinator = start_coordinator(drop_token_ids=True)
    assert [r["token_ids"] for r in stored(dropped)["results"]] == [[], []]
    assert dropped.client.get("/directory/stats").json()["token_ids"] is None
