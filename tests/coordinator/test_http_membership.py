"""Membership over HTTP against a real coordinator: register, heartbeat, deregister,
incarnations, contracts, expiry and the fences they cause."""

from __future__ import annotations

import logging
import re
import time

import pytest

from kvatlas.core.types import Tier
from support.coordinator import RunningCoordinator
from support.wait import wait_until

from .events import batch, fake_hash, json_body, key, register_body
from .lmcache_shapes import INCARNATION, events_body, store_batch

JSON = {"content-type": "application/json"}


def placements(rc: RunningCoordinator, h: bytes) -> list[dict[str, object]]:
    k = key(h)
    r = rc.client.post(
        "/directory/lookup",
        json={
            "keys": [{"chunk_hash_hex": h.hex(), "model_name": k.model_name, "kv_rank": k.kv_rank}]
        },
    )
    assert r.status_code == 200, r.text
    out: list[dict[str, object]] = r.json()["results"][0]["placements"]
    return out


def test_register_list_heartbeat_deregister(
    coord: RunningCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    c = coord.client
    with caplog.at_level(logging.INFO, logger="kvatlas.coordinator"):
        r = c.post(
            "/instances", json=register_body("node-a", p2p_advertised_url="tcp://127.0.0.1:9000")
        )
    assert r.status_code == 200
    assert r.json() == {"instance_id": "node-a", "re_registered": False, "incarnation": 1}
    assert "Registered instance node-a at 127.0.0.1:7555" in caplog.text
    listed = c.get("/instances").json()["instances"]
    assert [i["instance_id"] for i in listed] == ["node-a"]
    assert listed[0]["p2p_advertised_url"] == "tcp://127.0.0.1:9000"
    assert c.put("/instances/node-a/heartbeat").json() == {"instance_id": "node-a"}
    assert c.delete("/instances/node-a").status_code == 204
    assert c.get("/instances").json() == {"instances": []}
    r = c.put("/instances/node-a/heartbeat")
    assert r.status_code == 404
    assert r.json() == {"error": "unknown instance node-a; re-register"}
    assert c.delete("/instances/never-seen").status_code == 204


def test_empty_instance_id_is_generated_and_lmcache_body_accepted(
    coord: RunningCoordinator,
) -> None:
    r = coord.client.post(
        "/instances",
        json={
            "instance_id": "",
            "ip": "10.0.0.1",
            "http_port": 8000,
            "metadata": {"a": "b"},
            "p2p_advertised_url": None,
            "mq_port": None,
        },
    )
    assert r.status_code == 200
    iid = r.json()["instance_id"]
    assert re.fullmatch(r"mp-[0-9a-f]{32}", iid)  # LMCache 0.5.6's generated ids
    assert r.json()["re_registered"] is False


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("ip", "", "ip must not be empty"),
        ("ip", " \t", "ip must not be empty"),
        ("http_port", 0, "http_port must be in [1, 65535]"),
        ("http_port", 65536, "http_port"),
    ],
)
def test_registration_without_a_reachable_address_is_refused(
    coord: RunningCoordinator, field: str, value: object, reason: str
) -> None:
    body = {"instance_id": "node-a", "ip": "10.0.0.1", "http_port": 8000, field: value}
    r = coord.client.post("/instances", json=body)
    assert r.status_code == 400
    assert reason in r.json()["error"]
    assert coord.client.get("/instances").json() == {"instances": []}


def test_registration_fields_are_stripped_as_lmcache_does(coord: RunningCoordinator) -> None:
    body = {"instance_id": " node-a\n", "ip": " 10.0.0.1 ", "http_port": 8000}
    assert coord.client.post("/instances", json=body).json()["instance_id"] == "node-a"
    (listed,) = coord.client.get("/instances").json()["instances"]
    assert (listed["instance_id"], listed["ip"]) == ("node-a", "10.0.0.1")


def test_re_registration_of_same_incarnation_is_flagged(coord: RunningCoordinator) -> None:
    c = coord.client
    c.post("/instances", json=register_body("node-a"))
    r = c.post("/instances", json=register_body("node-a"))
    assert r.json()["re_registered"] is True


def test_contract_mismatch_is_409_naming_the_field(coord: RunningCoordinator) -> None:
    c = coord.client
    contract = {"model_name": "llama", "kv_dtype": "bfloat16", "kv_layout": [32, 8, 128]}
    assert c.post("/instances", json=register_body("node-a", contract=contract)).status_code == 200
    bad = {**contract, "kv_dtype": "float16"}
    r = c.post("/instances", json=register_body("node-b", contract=bad))
    assert r.status_code == 409
    assert "kv_dtype" in r.json()["error"]
    r = c.post("/instances", json=register_body("node-c", contract={**contract, "chunk_size": 512}))
    assert r.status_code == 409 and "chunk_size" in r.json()["error"]


def test_stale_incarnation_is_409(coord: RunningCoordinator) -> None:
    c = coord.client
    c.post("/instances", json=register_body("node-a", incarnation=5))
    r = c.post("/instances", json=register_body("node-a", incarnation=4))
    assert r.status_code == 409
    assert "stale incarnation 4" in r.json()["error"]


def test_new_incarnation_fences_l1_keeps_l2(coord: RunningCoordinator) -> None:
    c = coord.client
    c.post("/instances", json=register_body("node-a", incarnation=1))
    h1, h2 = fake_hash(1), fake_hash(2)
    body = json_body(batch("node-a", 1, [h1]), batch("node-a", 2, [h2], tier=Tier.L2))
    assert c.post("/events", content=body, headers=JSON).json()["applied"] == 2
    assert len(placements(coord, h1)) == 1
    r = c.post("/instances", json=register_body("node-a", incarnation=2))
    assert r.json()["re_registered"] is True
    assert placements(coord, h1) == []
    assert [p["tier"] for p in placements(coord, h2)] == ["l2"]
    # events of the old incarnation are stale now
    r = c.post("/events", content=json_body(batch("node-a", 3, [h1])), headers=JSON)
    assert r.json()["stale"] == 1


def test_deregister_fences_l1_and_forgets_cursor(coord: RunningCoordinator) -> None:
    c = coord.client
    c.post("/instances", json=register_body("node-a"))
    h1, h2 = fake_hash(1), fake_hash(2)
    c.post(
        "/events",
        content=json_body(batch("node-a", 1, [h1]), batch("node-a", 2, [h2], tier=Tier.L2)),
        headers=JSON,
    )
    assert c.delete("/instances/node-a").status_code == 204
    assert placements(coord, h1) == []
    assert len(placements(coord, h2)) == 1
    stats = c.get("/directory/stats").json()
    assert stats["cursors"] == []


def test_heartbeat_expiry_fences_l1(
    start_coordinator: object, caplog: pytest.LogCaptureFixture
) -> None:
    rc: RunningCoordinator = start_coordinator(instance_timeout=0.4, health_check_interval=0.05)  # type: ignore[operator]
    c = rc.client
    c.post("/instances", json=register_body("node-a"))
    c.post("/instances", json=register_body("node-b"))
    h1, h2 = fake_hash(1), fake_hash(2)
    c.post(
        "/events",
        content=json_body(batch("node-a", 1, [h1]), batch("node-a", 2, [h2], tier=Tier.L2)),
        headers=JSON,
    )

    def beat_and_list() -> list[str]:
        """node-b keeps beating; who the coordinator lists."""
        c.put("/instances/node-b/heartbeat")
        return rc.instance_ids()

    with caplog.at_level(logging.INFO, logger="kvatlas.coordinator"):
        wait_until(
            beat_and_list,
            lambda ids: ids == ["node-b"],
            what="node-a expired while node-b beats",
            timeout=5,
        )
    assert placements(coord := rc, h1) == []
    assert len(placements(coord, h2)) == 1
    assert "Instance node-a (incarnation 1) expired" in caplog.text
    assert c.put("/instances/node-a/heartbeat").status_code == 404
    metrics = c.get("/metrics").text
    assert "kvatlas_coordinator_expiries_total 1.0" in metrics
    assert 'kvatlas_coordinator_heartbeat_age_seconds{instance_id="node-b"}' in metrics


def test_events_before_registration_are_provisional_and_expire(start_coordinator: object) -> None:
    rc: RunningCoordinator = start_coordinator(instance_timeout=0.3, health_check_interval=0.05)  # type: ignore[operator]
    c = rc.client
    h = fake_hash(7)
    r = c.post("/events", content=json_body(batch("ghost", 1, [h])), headers=JSON)
    assert r.json()["provisional"] == 1
    assert c.get("/directory/stats").json()["provisional_instances"] == ["ghost"]
    wait_until(
        lambda: placements(rc, h),
        lambda ps: ps == [],
        what="the provisional placement to expire",
        timeout=5,
    )


def test_lmcache_registration_without_incarnation_takes_the_events_one(
    start_coordinator: object,
) -> None:
    """LMCache's `POST /instances` has no incarnation; its events carry the process start
    time. The instance stays registered (not provisional, so it does not expire while it
    heartbeats) and lists the events' incarnation."""
    now = [time.time()]
    rc: RunningCoordinator = start_coordinator(  # type: ignore[operator]
        instance_timeout=1.0, health_check_interval=1.0, clock=lambda: now[0]
    )
    c = rc.client
    body = {
        "instance_id": "mp-1",
        "ip": "127.0.0.1",
        "http_port": 8080,
        "metadata": {},
        "p2p_advertised_url": "127.0.0.1:7700",
        "mq_port": 5555,
    }
    r = c.post("/instances", json=body)
    assert r.json() == {"instance_id": "mp-1", "re_registered": False, "incarnation": 0}
    r = c.post(
        "/events",
        content=events_body(store_batch("mp-1", 1, [fake_hash(1)], 10)),
        headers=JSON,
    )
    assert (r.json()["applied"], r.json()["provisional"]) == (1, 0)
    sweep = rc.coordinator.membership.sweep
    for _ in range(6):  # three timeouts pass on the coordinator's clock: heartbeats keep it
        now[0] += 0.5
        sweep()
        assert c.put("/instances/mp-1/heartbeat").status_code == 200
    [inst] = c.get("/instances").json()["instances"]
    assert (inst["incarnation"], inst["p2p_advertised_url"], inst["mq_port"]) == (
        INCARNATION,
        "127.0.0.1:7700",
        5555,
    )
    assert c.get("/directory/stats").json()["provisional_instances"] == []
    assert placements(rc, fake_hash(1))[0]["incarnation"] == INCARNATION
    # a re-registration (LMCache re-registers after a 404) is not refused as stale
    r = c.post("/instances", json=body)
    assert r.json() == {"instance_id": "mp-1", "re_registered": True, "incarnation": INCARNATION}
    # and without heartbeats the same clock expires it: the loop above was not vacuous
    now[0] += 1.5
    sweep()
    assert c.get("/instances").json()["instances"] == []


def test_registration_metadata_and_fields_are_capped(coord: RunningCoordinator) -> None:
    """Registration metadata is capped: without a cap, one huge metadata made every
    `GET /instances` as large."""
    c = coord.client
    big = {"k": "x" * (10 * 2**20)}
    r = c.post("/instances", json=register_body("node-a", metadata=big))
    assert r.status_code == 413 and "metadata" in r.json()["error"], r.text[:200]
    r = c.post("/instances", json=register_body("node-a", ip="1" * 5000))
    assert r.status_code == 413 and "ip" in r.json()["error"], r.text[:200]
    fits = {f"k{i}": "v" * 1000 for i in range(16)}  # 16 * 1002 bytes < 16 KiB
    assert c.post("/instances", json=register_body("node-b", metadata=fits)).status_code == 200
    assert len(c.get("/instances").content) < 32 * 1024
