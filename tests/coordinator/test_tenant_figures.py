"""Per-tenant figures on a real coordinator over HTTP: with an operator token set, only
requests bearing it see anything per ``cache_salt`` (the tenant's identity); a fleet-token
caller gets the sums without a salt, or a 403 where a route is nothing but per-salt. With
no operator token (LMCache's coordinator has none), every token holder sees them, as
before. Each route is asked both ways.

| route | fleet token, operator token set |
|---|---|
| `GET /metrics` | no `cache_salt` label; the sums (`..._l2_accounted_bytes`, ...) |
| `GET /ui/fleet.json` | quotas with `salts` empty, `salts_hidden`, the sums; no cursors |
| `GET /quota` | `total_gb`, `by_cache_salt` empty |
| `GET /quota/{cache_salt}` | 403 |
| `GET /quota/config` | 200 (no salt in it) |
| `GET /cache/pins` | 403 |
| `GET /directory/keys` | 403 |
| `GET /directory/stats` | 200: counts by tier and instance, no salt, no cursors |
| `POST /directory/lookup` | 200: a caller names the salt it asks about (servers, the router) |
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey, pack_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.fleet_view import FleetDocument
from support.coordinator import RunningCoordinator

from .events import json_body

Start = Callable[..., RunningCoordinator]
MIB = 2**20
GIB = 2**30
RANK = pack_kv_rank(1, 0, 1, 0)
A, B = "tenant-alpha-7f3", "tenant-bravo-9c1"
"""Salts no other text of an answer could contain by chance."""
OPERATOR = {"Authorization": "Bearer op-token"}


def key(i: int, salt: str) -> ObjectKey:
    return ObjectKey(bytes([i]) * 32, "m", RANK, 0, salt)


def fill(rc: RunningCoordinator, c: httpx.Client) -> None:
    """A: 3 MiB in L2 over its 2 MiB quota, B: 1 MiB, and one pin of B's."""
    entries = tuple(Entry(key(i, s), MIB) for i, s in enumerate((A, A, A, B)))
    batch = EventBatch(
        InstanceId("s1"), Incarnation(1), 1, EventType.STORE, Tier.L2, entries, backend="fs"
    )
    r = c.post("/events", content=json_body(batch), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert c.put("/quota/" + A, json={"limit_gb": 2 / 1024}, headers=OPERATOR).status_code == 200
    pin = {"model_name": "m", "world_size": 1, "token_ids": list(range(256)), "cache_salt": B}
    assert c.post("/cache/pins", json=pin, headers=OPERATOR).status_code == 200


@pytest.fixture
def guarded(start_coordinator: Start) -> tuple[RunningCoordinator, httpx.Client]:
    """A coordinator with the fleet token and an operator token; its client holds the
    fleet token (a server's, an engine's)."""
    rc = start_coordinator(
        eviction_check_interval=0, auth_token="fleet-token", operator_token="op-token"
    )
    fill(rc, rc.client)
    return rc, rc.client


def value(text: str, name: str, **labels: str) -> float | None:
    """The sample ``name{labels}`` of an exposition text (None: absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def _no_salt(text: str) -> None:
    assert A not in text and B not in text, text[:2000]


def test_metrics_per_salt_for_the_operator_only(
    guarded: tuple[RunningCoordinator, httpx.Client],
) -> None:
    _, c = guarded
    fleet = c.get("/metrics").text
    _no_salt(fleet)
    assert "cache_salt=" not in fleet
    assert value(fleet, "kvatlas_coordinator_l2_accounted_bytes") == 4 * MIB
    assert value(fleet, "kvatlas_coordinator_salts_over_quota") == 1
    assert value(fleet, "kvatlas_coordinator_pinned_keys") == 1
    assert value(fleet, "kvatlas_coordinator_l2_salt_bytes", cache_salt=A) is None
    operator = c.get("/metrics", headers=OPERATOR).text
    assert value(operator, "kvatlas_coordinator_l2_salt_bytes", cache_salt=A) == 3 * MIB
    assert value(operator, "kvatlas_coordinator_quota_limit_bytes", cache_salt=A) == 2 * MIB
    assert value(operator, "kvatlas_coordinator_l2_accounted_bytes") == 4 * MIB


def test_fleet_page_document_sums_for_others(
    guarded: tuple[RunningCoordinator, httpx.Client],
) -> None:
    _, c = guarded
    raw = c.get("/ui/fleet.json").content
    _no_salt(raw.decode())
    doc = msgspec.json.decode(raw, type=FleetDocument)
    assert doc.quotas is not None
    assert (doc.quotas.salts, doc.quotas.salts_hidden) == ([], True)
    assert (doc.quotas.l2_bytes, doc.quotas.salts_over_quota, doc.quotas.pinned_keys) == (
        4 * MIB,
        1,
        1,
    )
    assert all(cur.last_seq is None for cur in doc.directory.cursors)
    page = c.get("/ui/fleet.json", headers=OPERATOR).content
    mine = msgspec.json.decode(page, type=FleetDocument)
    assert mine.quotas is not None and not mine.quotas.salts_hidden
    assert [(s.cache_salt, s.l2_bytes) for s in mine.quotas.salts] == [(A, 3 * MIB), (B, MIB)]
    assert [cur.last_seq for cur in mine.directory.cursors] == [1]


def test_quota_reads(guarded: tuple[RunningCoordinator, httpx.Client]) -> None:
    _, c = guarded
    listed = c.get("/quota")
    assert listed.status_code == 200
    assert listed.json() == {"total_gb": 4 * MIB / GIB, "by_cache_salt": []}
    mine = c.get("/quota", headers=OPERATOR).json()
    assert mine["total_gb"] == 4 * MIB / GIB
    assert [row["cache_salt"] for row in mine["by_cache_salt"]] == [A, B]
    one = c.get("/quota/" + A)
    assert one.status_code == 403 and "operator token" in one.json()["detail"]
    _no_salt(one.text)
    assert c.get("/quota/" + A, headers=OPERATOR).json()["quota_exists"] is True
    assert c.get("/quota/config").json() == {"default_limit_gb": None}
    pins = c.get("/cache/pins")
    assert pins.status_code == 403
    _no_salt(pins.text)
    got = c.get("/cache/pins", headers=OPERATOR).json()
    assert got["total"] == 1 and got["pins"][0]["key"]["cache_salt"] == B


def test_directory_listing_and_stats(guarded: tuple[RunningCoordinator, httpx.Client]) -> None:
    _, c = guarded
    keys = c.get("/directory/keys")
    assert keys.status_code == 403 and "operator token" in keys.json()["error"]
    listed = c.get("/directory/keys", headers=OPERATOR).json()
    assert sorted({k["cache_salt"] for k in listed["keys"]}) == [A, B]
    stats = c.get("/directory/stats")
    assert stats.status_code == 200
    _no_salt(stats.text)
    assert stats.json()["namespaces"] == 2  # a count, no name
    # Servers and the router look up by the namespace they name: unchanged.
    asked = {"chunk_hash_hex": key(0, A).chunk_hash.hex(), "model_name": "m", "kv_rank": RANK}
    found = c.post("/directory/lookup", json={"keys": [{**asked, "cache_salt": A}, asked]})
    assert [len(r["placements"]) for r in found.json()["results"]] == [1, 0]


def test_without_an_operator_token_every_token_holder_sees_them(start_coordinator: Start) -> None:
    """Today's behaviour and LMCache's: the fleet token reads every figure per salt."""
    rc = start_coordinator(eviction_check_interval=0, auth_token="fleet-token")
    c = rc.client
    entries = (Entry(key(1, A), MIB), Entry(key(2, B), MIB))
    batch = EventBatch(
        InstanceId("s1"), Incarnation(1), 1, EventType.STORE, Tier.L2, entries, backend="fs"
    )
    c.post("/events", content=json_body(batch), headers={"content-type": "application/json"})
    text = c.get("/metrics").text
    assert value(text, "kvatlas_coordinator_l2_salt_bytes", cache_salt=A) == MIB
    doc = msgspec.json.decode(c.get("/ui/fleet.json").content, type=FleetDocument)
    assert doc.quotas is not None and not doc.quotas.salts_hidden
    assert [s.cache_salt for s in doc.quotas.salts] == [A, B]
    assert [r["cache_salt"] for r in c.get("/quota").json()["by_cache_salt"]] == [A, B]
    assert c.get("/quota/" + A).status_code == 200
    assert c.get("/cache/pins").status_code == 200
    assert c.get("/directory/keys").json()["total"] == 2
