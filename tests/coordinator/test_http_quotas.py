"""The quota and pin routes on a real coordinator over HTTP: LMCache 0.5.6's shapes and
status codes, usage from the event stream, pins from token ids, the operator token,
LMCache's stats and keys fields, metrics, and a restart from the snapshot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from kvatlas.coordinator.app import Coordinator
from kvatlas.core.errors import ConfigError
from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from support.coordinator import BASE, RunningCoordinator

from .events import json_body

GIB = 1024**3
Start = Callable[..., RunningCoordinator]


def salted(i: int, salt: str) -> ObjectKey:
    return ObjectKey(i.to_bytes(4, "big") * 8, "m", pack_kv_rank(1, 0, 1, 0), 0, salt)


def store(
    rc: RunningCoordinator,
    iid: str,
    seq: int,
    keys: list[ObjectKey],
    *,
    tier: Tier = Tier.L2,
    size: int = GIB // 4,
    event: EventType = EventType.STORE,
) -> None:
    b = EventBatch(
        InstanceId(iid),
        Incarnation(1),
        seq,
        event,
        tier,
        tuple(Entry(k, size) for k in keys),
        backend="fs",
    )
    r = rc.client.post(
        "/events", content=json_body(b), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text


@pytest.fixture
def rc(start_coordinator: Start) -> RunningCoordinator:
    return start_coordinator(eviction_check_interval=0)


def test_quota_routes_answer_like_lmcache(rc: RunningCoordinator) -> None:
    c = rc.client
    assert c.get("/quota/config").json() == {"default_limit_gb": None}
    assert c.put("/quota/config", json={"default_limit_gb": 2}).json() == {"default_limit_gb": 2.0}
    assert c.get("/quota/config").json() == {"default_limit_gb": 2.0}
    r = c.put("/quota/alice", json={"limit_gb": 0.5})
    assert (r.status_code, r.json()) == (
        200,
        {"cache_salt": "alice", "limit_gb": 0.5, "status": "ok"},
    )
    r = c.put("/quota/_default", json={"limit_gb": 1, "tier": "l2"})
    assert r.json() == {"cache_salt": "", "limit_gb": 1.0, "status": "ok"}
    assert c.get("/quota/alice").json() == {
        "cache_salt": "alice",
        "quota_limit_gb": 0.5,
        "quota_exists": True,
        "usage_gb": 0.0,
    }
    assert c.get("/quota/bob").json()["quota_exists"] is False
    assert c.get("/quota/alice", params={"tier": "l1"}).json()["quota_exists"] is False
    assert c.get("/quota").json() == {
        "total_gb": 0.0,
        "by_cache_salt": [
            {"cache_salt": "", "quota_limit_gb": 1.0, "quota_exists": True, "usage_gb": 0.0},
            {"cache_salt": "alice", "quota_limit_gb": 0.5, "quota_exists": True, "usage_gb": 0.0},
        ],
    }
    assert c.get("/quota", params={"tier": "l1"}).json() == {"total_gb": 0.0, "by_cache_salt": []}
    assert c.delete("/quota/alice").json() == {
        "cache_salt": "alice",
        "limit_gb": 0.0,
        "status": "removed",
    }
    assert c.delete("/quota/alice").json()["status"] == "not_found"
    # As LMCache's routing: DELETE /quota/config is the quota of a salt named "config".
    assert c.delete("/quota/config").json() == {
        "cache_salt": "config",
        "limit_gb": 0.0,
        "status": "not_found",
    }
    assert c.put("/quota/config", json={}).json() == {"default_limit_gb": None}


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "reason"),
    [
        ("PUT", "/quota/a", {"limit_gb": -1}, 422, "limit_gb"),
        ("PUT", "/quota/a", {}, 422, "limit_gb"),
        ("PUT", "/quota/a", None, 422, "invalid body"),
        ("PUT", "/quota/a", {"limit_gb": 1, "tier": "l1"}, 400, "tier 'l2' only"),
        ("PUT", "/quota/a", {"limit_gb": 1, "tier": "l3"}, 422, "tier"),
        ("PUT", "/quota/a", {"limit_gb": 1e30}, 422, "finite"),
        ("PUT", "/quota/config", {"default_limit_gb": 1, "tier": "all"}, 400, "'all'"),
        ("GET", "/quota/config?tier=l1", None, 400, "tier 'l2' only"),
        ("DELETE", "/quota/a?tier=l1", None, 400, "tier 'l2' only"),
        ("GET", "/quota?tier=all", None, 400, "no usage accounting"),
        ("GET", "/quota/a?tier=bogus", None, 422, "tier"),
        ("GET", "/cache/pins?limit=0", None, 422, "limit"),
        ("GET", "/cache/pins?limit=10001", None, 422, "limit"),
        ("GET", "/cache/pins?offset=-1", None, 422, "offset"),
        ("GET", "/cache/pins?offset=x", None, 422, "offset"),
        ("POST", "/cache/pins", {"model_name": "m"}, 422, "world_size"),
        ("POST", "/cache/pins", {"model_name": "m", "world_size": 0}, 422, "world_size"),
        (
            "POST",
            "/cache/pins",
            {"model_name": "m", "world_size": 1, "cache_salt": "a@b"},
            400,
            "cache_salt must not contain",
        ),
        (
            "DELETE",
            "/cache/pins",
            {"model_name": "m@x", "world_size": 1},
            400,
            "model_name must not contain",
        ),
        (
            "POST",
            "/cache/pins",
            {"model_name": "m", "world_size": 1, "cache_salt": "s" * 129},
            400,
            "max length 128",
        ),
        (
            "POST",
            "/cache/pins",
            {"model_name": "m", "world_size": 1, "token_ids": [0] * 1_000_001},
            400,
            "too many token_ids",
        ),
    ],
)
def test_bad_input_is_a_4xx_with_a_reason(
    rc: RunningCoordinator, method: str, path: str, body: object, status: int, reason: str
) -> None:
    r = rc.client.request(method, path, json=body)
    assert r.status_code == status, r.text
    assert reason in r.json()["detail"]


def test_usage_per_salt_from_events(rc: RunningCoordinator) -> None:
    store(rc, "s1", 1, [salted(1, "alice"), salted(2, "alice"), salted(3, "bob")])
    store(rc, "s2", 1, [salted(1, "alice")])  # a second copy counts too
    store(rc, "s1", 2, [salted(4, "alice")], tier=Tier.L1, size=GIB // 8)
    rc.client.put("/quota/alice", json={"limit_gb": 1})
    assert rc.client.get("/quota/alice").json() == {
        "cache_salt": "alice",
        "quota_limit_gb": 1.0,
        "quota_exists": True,
        "usage_gb": 0.75,
    }
    listing = rc.client.get("/quota").json()
    assert listing["total_gb"] == 1.0
    assert [(s["cache_salt"], s["usage_gb"]) for s in listing["by_cache_salt"]] == [
        ("alice", 0.75),
        ("bob", 0.25),
    ]
    l1 = rc.client.get("/quota", params={"tier": "l1"}).json()
    assert l1 == {
        "total_gb": 0.125,
        "by_cache_salt": [
            {"cache_salt": "alice", "quota_limit_gb": 0.0, "quota_exists": False, "usage_gb": 0.125}
        ],
    }
    store(rc, "s2", 2, [salted(1, "alice")], event=EventType.DELETE)
    assert rc.client.get("/quota/alice").json()["usage_gb"] == 0.5


def test_pins_resolve_token_ids_to_every_rank_of_each_chunk(rc: RunningCoordinator) -> None:
    tokens = list(range(3 * 256 + 10))  # three complete chunks and a tail
    body = {"model_name": "m", "world_size": 2, "token_ids": tokens, "cache_salt": "alice"}
    r = rc.client.post("/cache/pins", json=body)
    assert r.json() == {"requested": 3, "affected": 6, "status": "pinned"}
    rc.client.post("/cache/pins", json={**body, "token_ids": tokens[:256]})
    listing = rc.client.get("/cache/pins").json()
    hashes = [h.hex() for h in chunk_hashes(tokens, 256)]
    ranks = [pack_kv_rank(2, r, 2, r) for r in range(2)]
    assert listing["total"] == 6
    assert [(p["key"]["chunk_hash_hex"], p["key"]["kv_rank"]) for p in listing["pins"]] == [
        (h, rank) for h in hashes for rank in ranks
    ]
    assert [p["pin_count"] for p in listing["pins"]] == [2, 2, 1, 1, 1, 1]
    assert listing["pins"][0]["key"] == {
        "chunk_hash_hex": hashes[0],
        "model_name": "m",
        "kv_rank": ranks[0],
        "object_group_id": 0,
        "cache_salt": "alice",
    }
    page = rc.client.get("/cache/pins", params={"offset": 4, "limit": 1}).json()
    assert page["total"] == 6 and len(page["pins"]) == 1
    assert rc.client.get("/cache/pins", params={"cache_salt": "bob"}).json() == {
        "total": 0,
        "pins": [],
    }
    assert rc.client.get("/cache/pins", params={"model_name": "m"}).json()["total"] == 6
    r = rc.client.request("DELETE", "/cache/pins", json=body)
    assert r.json() == {"requested": 3, "affected": 6, "status": "unpinned"}
    assert rc.client.get("/cache/pins").json()["total"] == 2
    short = {"model_name": "m", "world_size": 1, "token_ids": [1, 2, 3]}
    assert rc.client.post("/cache/pins", json=short).json() == {
        "requested": 0,
        "affected": 0,
        "status": "pinned",
    }


def test_operator_token_guards_quota_and_pin_writes(start_coordinator: Start) -> None:
    rc = start_coordinator(
        eviction_check_interval=0, auth_token="shared-token", operator_token="op-token"
    )
    c = rc.client  # the shared token
    op = {"Authorization": "Bearer op-token"}
    pin = {"model_name": "m", "world_size": 1, "token_ids": list(range(256))}
    for method, path, body in [
        ("PUT", "/quota/a", {"limit_gb": 1}),
        ("DELETE", "/quota/a", None),
        ("PUT", "/quota/config", {"default_limit_gb": 1}),
        ("POST", "/cache/pins", pin),
        ("DELETE", "/cache/pins", pin),
    ]:
        r = c.request(method, path, json=body)
        assert r.status_code == 403, (method, path, r.text)
        assert "operator token" in r.json()["detail"]
        assert c.request(method, path, json=body, headers=op).status_code == 200
    assert c.get("/quota").status_code == 200  # the total, no salt (test_tenant_figures)
    assert c.get("/quota/config").status_code == 200
    assert c.get("/cache/pins").status_code == 403  # every pin names its salt
    assert c.get("/quota/config", headers={"Authorization": "Bearer nope"}).status_code == 401
    text = c.get("/metrics").text
    assert 'kvatlas_coordinator_operator_refusals_total{reason="auth"} 6.0' in text


def test_stats_and_keys_carry_lmcache_fields(rc: RunningCoordinator) -> None:
    store(rc, "s1", 1, [salted(1, "a"), salted(2, "a")], tier=Tier.L1, size=10)
    store(rc, "s2", 1, [salted(1, "a")], tier=Tier.L1, size=10)
    store(rc, "s2", 2, [salted(3, "a")], size=30)
    st = rc.stats()
    assert (st["num_keys"], st["num_placements"]) == (st["keys"], st["placements"]) == (3, 4)
    assert st["l1_keys_by_instance"] == {"s1": 2, "s2": 1}
    assert (st["l1_count"], st["l1_size_bytes"], st["l2_count"], st["l2_size_bytes"]) == (
        3,
        30,
        1,
        30,
    )
    keys = rc.client.get("/directory/keys", params={"limit": 1}).json()
    assert keys["total"] == 3 and len(keys["keys"]) == 1
    store(rc, "s2", 3, [salted(3, "a")], event=EventType.ACCESS)
    (row,) = rc.client.get("/directory/keys", params={"tier": "l2"}).json()["keys"]
    assert (row["access_count"], row["num_tokens"]) == (1, 0)
    assert rc.client.get("/directory/keys", params={"tier": "l2"}).json()["total"] == 1
    filtered = rc.client.get("/directory/keys", params={"instance": "s2", "limit": 1}).json()
    assert filtered["total"] == 2 and len(filtered["keys"]) == 1
    # LMCache's names: instance_id, tier=all; an empty filter filters nothing.
    lm = {"instance_id": "s1", "tier": "all", "backend": ""}
    assert rc.client.get("/directory/keys", params=lm).json()["total"] == 2
    # An instance whose L1 keys all went is listed with 0 until it is fenced.
    store(rc, "s1", 2, [salted(1, "a"), salted(2, "a")], tier=Tier.L1, event=EventType.DELETE)
    assert rc.stats()["l1_keys_by_instance"] == {"s1": 0, "s2": 1}
    rc.client.delete("/instances/s1")
    assert rc.stats()["l1_keys_by_instance"] == {"s2": 1}


def test_metrics_show_usage_quota_and_pins(rc: RunningCoordinator) -> None:
    store(rc, "s1", 1, [salted(1, "alice")], size=1000)
    rc.client.put("/quota/alice", json={"limit_gb": 1})
    rc.client.post("/cache/pins", json={"model_name": "m", "world_size": 1, "token_ids": [7] * 256})
    text = rc.client.get("/metrics").text
    assert 'kvatlas_coordinator_l2_salt_bytes{cache_salt="alice"} 1000.0' in text
    assert 'kvatlas_coordinator_quota_limit_bytes{cache_salt="alice"} 1.073741824e+09' in text
    assert "kvatlas_coordinator_pinned_keys 1.0" in text
    assert "kvatlas_coordinator_quota_default_bytes -1.0" in text
    assert 'kvatlas_coordinator_operator_writes_total{op="set_quota",transport="http"} 1.0' in text


def test_restart_keeps_quotas_pins_and_usage(start_coordinator: Start, tmp_path: Path) -> None:
    snap = str(tmp_path / "coord.snap")
    rc = start_coordinator(eviction_check_interval=0, snapshot_path=snap)
    store(rc, "s1", 1, [salted(1, "alice"), salted(2, "alice")], size=GIB // 2)
    rc.client.put("/quota/alice", json={"limit_gb": 3})
    rc.client.put("/quota/config", json={"default_limit_gb": 0.25})
    pin = {"model_name": "m", "world_size": 1, "token_ids": list(range(512))}
    rc.client.post("/cache/pins", json=pin)
    rc.client.post("/cache/pins", json=pin)
    before = [rc.client.get(p).json() for p in ("/quota", "/quota/config", "/cache/pins")]
    rc.stop()
    assert (tmp_path / "coord.snap.operator").exists()
    assert (tmp_path / "coord.snap.l2usage").exists()
    again = start_coordinator(eviction_check_interval=0, snapshot_path=snap)
    after = [again.client.get(p).json() for p in ("/quota", "/quota/config", "/cache/pins")]
    assert after == before
    assert after[0]["by_cache_salt"][0]["usage_gb"] == 1.0
    assert after[2]["total"] == 2 and {p["pin_count"] for p in after[2]["pins"]} == {2}


def test_operator_writes_survive_a_crash_without_a_snapshot(
    start_coordinator: Start, tmp_path: Path
) -> None:
    """The operator file is written at every write, not only with snapshots: a second
    coordinator started on it (the first never shut down) has the quota."""
    snap = str(tmp_path / "coord.snap")
    rc = start_coordinator(eviction_check_interval=0, snapshot_path=snap)
    rc.client.put("/quota/bob", json={"limit_gb": 2})
    other = start_coordinator(eviction_check_interval=0, snapshot_path=snap)
    assert other.client.get("/quota/bob").json()["quota_limit_gb"] == 2.0


def test_corrupt_operator_file_refuses_the_start(tmp_path: Path) -> None:
    (tmp_path / "c.snap.operator").write_bytes(b"KVATSNAP garbage")
    with pytest.raises(ConfigError, match=r"c\.snap\.operator"):
        Coordinator(replace(BASE, snapshot_path=str(tmp_path / "c.snap")))
