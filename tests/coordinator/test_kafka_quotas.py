"""Quotas and pins on Kafka replicas against the real tansu broker: a write to one
replica is applied by every replica from the log, and a replica restarted from its
snapshot and operator file replays the log without counting a pin twice."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from confluent_kafka import Producer

from kvatlas.coordinator.snapshot import unframe
from kvatlas.core.coordinator.quotas import OperatorCapture
from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey, pack_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.kafka_records import encode_batch_msgpack
from support.coordinator import RunningCoordinator
from support.wait import wait_until

pytestmark = [pytest.mark.kafka]

Start = Callable[..., RunningCoordinator]
GIB = 1024**3
PIN: dict[str, Any] = {
    "model_name": "m",
    "world_size": 1,
    "token_ids": list(range(512)),
    "cache_salt": "a",
}
READS = ("/quota", "/quota/config", "/cache/pins")


@pytest.fixture
def topic(kafka_broker: Any) -> str:
    name = f"quotas-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(name, partitions=4)
    return name


def cfg(kafka_broker: Any, topic: str, **extra: Any) -> dict[str, Any]:
    return {
        "event_transport": "kafka",
        "kafka_bootstrap_servers": kafka_broker.bootstrap,
        "kafka_topic": topic,
        "eviction_check_interval": 0,
        **extra,
    }


def views(rc: RunningCoordinator) -> list[Any]:
    return [rc.client.get(p).json() for p in READS]


def agree(*replicas: RunningCoordinator) -> list[Any]:
    """Wait until every replica answers the quota and pin reads alike."""
    seen = wait_until(
        lambda: [views(rc) for rc in replicas],
        lambda got: all(v == got[0] for v in got),
        what="the replicas to agree on quotas and pins",
        timeout=30,
    )
    first: list[Any] = seen[0]
    return first


def test_writes_on_either_replica_reach_both(
    start_coordinator: Start, kafka_broker: Any, topic: str
) -> None:
    a = start_coordinator(**cfg(kafka_broker, topic))
    b = start_coordinator(**cfg(kafka_broker, topic))
    a.wait_ready()
    b.wait_ready()
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    key = ObjectKey(b"\x07" * 32, "m", pack_kv_rank(1, 0, 1, 0), 0, "a")
    batch = EventBatch(
        InstanceId("s1"), Incarnation(1), 1, EventType.STORE, Tier.L2, (Entry(key, GIB),)
    )
    producer.produce(topic, key="s1", value=encode_batch_msgpack(batch))
    assert producer.flush(10) == 0
    assert a.client.put("/quota/a", json={"limit_gb": 2}).json()["status"] == "ok"
    # Read-your-writes on the replica that took it: answered once applied there.
    assert a.client.get("/quota/a").json()["quota_limit_gb"] == 2.0
    assert b.client.put("/quota/config", json={"default_limit_gb": 0.5}).status_code == 200
    assert b.client.post("/cache/pins", json=PIN).json()["affected"] == 2
    assert a.client.post("/cache/pins", json=PIN).json()["affected"] == 2
    assert b.client.delete("/quota/zzz").json()["status"] == "not_found"
    quotas, config, pins = agree(a, b)
    assert config == {"default_limit_gb": 0.5}
    assert quotas["by_cache_salt"] == [
        {"cache_salt": "a", "quota_limit_gb": 2.0, "quota_exists": True, "usage_gb": 1.0}
    ]
    assert pins["total"] == 2 and {p["pin_count"] for p in pins["pins"]} == {2}
    text = b.client.get("/metrics").text
    assert 'kvatlas_coordinator_operator_writes_total{op="pin",transport="kafka"} 2.0' in text


def test_restart_replays_the_log_without_counting_twice(
    start_coordinator: Start, kafka_broker: Any, topic: str, tmp_path: Path
) -> None:
    snap = str(tmp_path / "a.snap")
    a = start_coordinator(**cfg(kafka_broker, topic, snapshot_path=snap))
    b = start_coordinator(**cfg(kafka_broker, topic))
    a.wait_ready()
    b.wait_ready()
    a.client.post("/cache/pins", json=PIN)
    a.client.put("/quota/a", json={"limit_gb": 1})
    agree(a, b)
    a.stop()  # snapshot with the log positions; the operator file is newer or equal
    # Written while a is down: a must read it from the log when it comes back.
    b.client.post("/cache/pins", json=PIN)
    b.client.request("DELETE", "/cache/pins", json={**PIN, "token_ids": PIN["token_ids"][:256]})
    want = agree(b)
    again = start_coordinator(**cfg(kafka_broker, topic, snapshot_path=snap))
    again.wait_ready()
    got = agree(again, b)
    assert got == want
    assert [p["pin_count"] for p in got[2]["pins"]] == [1, 2]


def test_a_replica_that_lost_its_snapshot_rebuilds_from_the_operator_file_and_log(
    start_coordinator: Start, kafka_broker: Any, topic: str, tmp_path: Path
) -> None:
    """Only the operator file is left (the snapshot was never written: a crash): the
    log is replayed from its start over it, and the positions the file carries keep
    each pin counted once."""
    snap = tmp_path / "a.snap"
    a = start_coordinator(**cfg(kafka_broker, topic, snapshot_path=str(snap)))
    a.wait_ready()
    a.client.post("/cache/pins", json=PIN)
    a.client.post("/cache/pins", json=PIN)
    want = agree(a)
    a.stop()
    snap.unlink()
    kept = msgspec.msgpack.decode(
        unframe((tmp_path / "a.snap.operator").read_bytes()), type=OperatorCapture
    )
    assert kept.positions and len(kept.pins) == 2
    again = start_coordinator(**cfg(kafka_broker, topic, snapshot_path=str(snap)))
    again.wait_ready()
    assert agree(again) == want
