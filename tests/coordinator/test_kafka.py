"""Kafka ingest and replicas against the real tansu broker: every replica consumes every
partition, membership travels through the log, and all replicas reach the same
directory; restarts resume from the offsets stored with the snapshot."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from confluent_kafka import Producer

from kvatlas.coordinator.snapshot import unframe
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.events import EventBatch
from kvatlas.core.types import EventType, Tier
from kvatlas.wire.events_api import batch_from_core, compact_batch
from kvatlas.wire.kafka_records import encode_batch_msgpack
from support.coordinator import RunningCoordinator
from support.services import start_coordinator_process
from support.wait import wait_until

from .events import batch, block_batch, fake_hash, key, register_body
from .lmcache_shapes import INCARNATION, config_batch, events_body, store_batch

pytestmark = [pytest.mark.kafka]

Start = Callable[..., RunningCoordinator]


@pytest.fixture
def topic(kafka_broker: Any) -> str:
    name = f"events-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(name, partitions=8)
    return name


@pytest.fixture
def producer(kafka_broker: Any) -> Any:
    p = Producer(
        {
            "bootstrap.servers": kafka_broker.bootstrap,
            "partitioner": "murmur2_random",
            "linger.ms": 2,
        }
    )
    yield p
    p.flush(10)


def kafka_cfg(kafka_broker: Any, topic: str, **extra: Any) -> dict[str, Any]:
    return {
        "event_transport": "kafka",
        "kafka_bootstrap_servers": kafka_broker.bootstrap,
        "kafka_topic": topic,
        **extra,
    }


def publish(producer: Any, topic: str, batches: list[EventBatch], json: bool = False) -> None:
    for b in batches:
        value = msgspec.json.encode(batch_from_core(b)) if json else encode_batch_msgpack(b)
        producer.produce(topic, key=b.instance_id, value=value)
    assert producer.flush(10) == 0


def stats(client: Any) -> dict[str, Any]:
    out: dict[str, Any] = client.get("/directory/stats", params={"digest": "1"}).json()
    return out


def converge(*clients: Any, keys: int) -> str:
    """Wait until every replica holds ``keys`` keys and all digests agree."""

    def views() -> list[tuple[int, str, list[Any], dict[str, int]]]:
        ss = [stats(c) for c in clients]
        return [(s["keys"], s["digest"], s["cursors"], s["kafka_positions"]) for s in ss]

    wait_until(
        views,
        lambda vs: all(v[0] == keys for v in vs) and len({v[1] for v in vs}) == 1,
        what=f"every replica at {keys} keys with one digest",
        timeout=15,
    )
    return str(stats(clients[0])["digest"])


def test_replicas_agree_on_directory_and_membership(
    kafka_broker: Any, topic: str, producer: Any, start_coordinator: Start
) -> None:
    a = start_coordinator(**kafka_cfg(kafka_broker, topic))
    b = start_coordinator(**kafka_cfg(kafka_broker, topic))
    a.wait_ready()
    b.wait_ready()
    # membership through replica A: it answers synchronously, and B learns it from the log
    r = a.client.post("/instances", json=register_body("node-a"))
    assert r.status_code == 200 and r.json()["re_registered"] is False
    r = b.client.post("/instances", json=register_body("node-b", contract={"model_name": "llama"}))
    assert r.status_code == 200
    # A refuses node-c's contract from its view once it has read node-b's record (on
    # another partition); registrations that race through different replicas are
    # decided by their contract claims' order (test_kafka_contract_race.py)
    wait_until(a.instance_ids, lambda ids: len(ids) == 2, what="A lists both", timeout=15)
    r = a.client.post(
        "/instances",
        json=register_body("node-c", contract={"model_name": "llama", "chunk_size": 16}),
    )
    assert r.status_code == 409 and "chunk_size" in r.json()["error"]
    wait_until(b.instance_ids, lambda ids: len(ids) == 2, what="B lists both", timeout=15)
    assert b.client.put("/instances/node-a/heartbeat").status_code == 200
    assert a.client.put("/instances/nobody/heartbeat").status_code == 404
    # events from the log, both encodings, with a duplicate and a gap
    batches = [batch("node-a", s, [fake_hash(i, s) for i in range(64)]) for s in range(1, 6)]
    batches += [
        batch("node-b", s, [fake_hash(i, 100 + s) for i in range(64)], tier=Tier.L2)
        for s in (1, 2, 4)
    ]
    publish(producer, topic, batches[:4])
    publish(producer, topic, batches[3:], json=True)
    digest = converge(a.client, b.client, keys=64 * 8)
    sa, sb = stats(a.client), stats(b.client)
    assert sa["cursors"] == sb["cursors"]
    assert {c["instance_id"]: c["gaps"] for c in sa["cursors"]} == {"node-a": 0, "node-b": 1}
    # lookups from either replica
    for rc in (a, b):
        k = key(fake_hash(0, 1))
        res = rc.client.post(
            "/directory/lookup",
            json={
                "keys": [
                    {
                        "chunk_hash_hex": k.chunk_hash.hex(),
                        "model_name": k.model_name,
                        "kv_rank": k.kv_rank,
                    }
                ]
            },
        ).json()["results"][0]
        assert [p["instance_id"] for p in res["placements"]] == ["node-a"]
    # deregistration through B fences node-a's L1 on both replicas
    assert b.client.delete("/instances/node-a").status_code == 204
    assert [i["instance_id"] for i in b.client.get("/instances").json()["instances"]] == ["node-b"]
    after = converge(a.client, b.client, keys=64 * 3)
    assert after != digest
    wait_until(a.instance_ids, lambda ids: ids == ["node-b"], what="A lists only node-b")
    # POST /events is refused: events must go through the topic
    r = a.client.post("/events", content=b'{"batches": []}')
    assert r.status_code == 409 and topic in r.json()["error"]
    m = a.client.get("/metrics").text
    assert 'kvatlas_coordinator_kafka_records_total{kind="batch"} 9.0' in m  # one resent
    assert 'kvatlas_coordinator_ingest_batches_total{outcome="applied",transport="kafka"} 8.0' in m
    assert (
        'kvatlas_coordinator_ingest_batches_total{outcome="duplicate",transport="kafka"} 1.0' in m
    )


def test_undecodable_records_are_counted_and_skipped(
    kafka_broker: Any, topic: str, producer: Any, start_coordinator: Start
) -> None:
    a = start_coordinator(**kafka_cfg(kafka_broker, topic))
    for value in (b"garbage", b'{"instance_id": 1}', b"KVM1\xc1", b""):
        producer.produce(topic, key="node-x", value=value)
    publish(producer, topic, [batch("node-x", 1, [fake_hash(1)])])
    a.wait_ready()
    wait_until(lambda: stats(a.client)["keys"], lambda n: n == 1, what="one key", timeout=15)
    m = a.client.get("/metrics").text
    assert 'kvatlas_coordinator_kafka_records_total{kind="undecodable"} 4.0' in m


def test_lmcache_records_config_and_unknown_types(
    kafka_broker: Any, topic: str, producer: Any, start_coordinator: Start
) -> None:
    """LMCache's sinks send ``{"batches": [batch]}`` per record: config batches declare,
    a batch of an unknown type is skipped and still moves the gate, and a record whose
    known batch is malformed is skipped whole."""
    a = start_coordinator(**kafka_cfg(kafka_broker, topic))
    future = {"instance_id": "mp-1", "incarnation": INCARNATION, "seq": 3, "event_type": "pin"}
    records = [
        events_body(config_batch("mp-1", 1, "l1", "dram", 1 << 30, 1)),
        events_body(store_batch("mp-1", 2, [fake_hash(i) for i in range(4)], 1 << 20)),
        events_body(future),
        events_body(config_batch("mp-1", 9, "l1", "", 1, 2)),  # malformed: no backend
        msgspec.json.encode(store_batch("mp-1", 4, [fake_hash(7)], 1 << 20)),  # a bare batch
    ]
    for value in records:
        producer.produce(topic, key="mp-1", value=value)
    assert producer.flush(10) == 0
    a.wait_ready()
    wait_until(lambda: stats(a.client)["keys"], lambda n: n == 5, what="five keys", timeout=15)
    s = stats(a.client)
    assert [(c["last_seq"], c["gaps"]) for c in s["cursors"]] == [(4, 0)]
    [module] = a.client.get("/instances/mp-1/usage").json()["modules"]
    assert (module["used_bytes"], module["capacity_bytes"]) == (5 << 20, 1 << 30)
    m = a.client.get("/metrics").text
    assert 'kvatlas_coordinator_skipped_batches_total{event_type="pin",transport="kafka"} 1.0' in m
    assert 'kvatlas_coordinator_kafka_records_total{kind="undecodable"} 1.0' in m


def test_key_block_records_are_applied(
    kafka_broker: Any, topic: str, producer: Any, start_coordinator: Start
) -> None:
    """The servers' sinks send the block form; JSON records of the same batches expand it."""
    a = start_coordinator(**kafka_cfg(kafka_broker, topic))
    hs = [fake_hash(i, 7) for i in range(300)]
    blocks = [
        compact_batch(batch("node-a", 1, hs[:256])),
        block_batch("node-a", 2, hs[256:], head=(hs[0],), tier=Tier.L2),
        block_batch("node-a", 3, hs[:6], event=EventType.DELETE),
    ]
    assert blocks[0].block is not None and blocks[0].entries == ()
    publish(producer, topic, blocks)
    publish(producer, topic, [block_batch("node-j", 1, hs[:3])], json=True)
    a.wait_ready()
    wait_until(
        lambda: stats(a.client)["placements"], lambda n: n == 250 + 45 + 3, what="298 placements"
    )
    s = stats(a.client)
    assert s["keys"] == 297  # hs[0] is still in L2; hs[1:3] only at node-j
    assert {c["instance_id"]: c["last_seq"] for c in s["cursors"]} == {"node-a": 3, "node-j": 1}
    m = a.client.get("/metrics").text
    applied = 'kvatlas_coordinator_ingest_entries_total{outcome="applied",transport="kafka"}'
    assert f"{applied} {256 + 45 + 6 + 3}.0" in m


def test_expiry_travels_through_the_log(
    kafka_broker: Any, topic: str, producer: Any, start_coordinator: Start
) -> None:
    cfg = kafka_cfg(kafka_broker, topic, instance_timeout=1.0, health_check_interval=0.1)
    a = start_coordinator(**cfg)
    b = start_coordinator(**cfg)
    a.wait_ready()
    b.wait_ready()
    a.client.post("/instances", json=register_body("node-a"))
    a.client.post("/instances", json=register_body("node-b"))
    publish(
        producer,
        topic,
        [
            batch("node-a", 1, [fake_hash(1)]),
            batch("node-a", 2, [fake_hash(2)], tier=Tier.L2),
            batch("node-b", 1, [fake_hash(3)]),
        ],
    )
    converge(a.client, b.client, keys=3)

    def beat_and_list() -> list[set[str]]:
        """node-b keeps beating, on each replica in turn; who each replica lists."""
        for rc in (a, b):
            rc.client.put("/instances/node-b/heartbeat")
        return [set(rc.instance_ids()) for rc in (a, b)]

    wait_until(
        beat_and_list,
        lambda ids: ids == [{"node-b"}, {"node-b"}],
        what="node-a expired on both replicas while node-b beats",
        timeout=10,
        every=0.1,
    )
    converge(a.client, b.client, keys=2)  # node-a's L1 key fenced, its L2 key kept
    assert a.client.put("/instances/node-a/heartbeat").status_code == 404


def test_restart_resumes_from_snapshot_offsets(
    kafka_broker: Any, topic: str, producer: Any, start_coordinator: Start, tmp_path: Path
) -> None:
    snap = str(tmp_path / "a.snap")
    a = start_coordinator(**kafka_cfg(kafka_broker, topic, snapshot_path=snap))
    b = start_coordinator(**kafka_cfg(kafka_broker, topic))
    a.wait_ready()
    a.client.post("/instances", json=register_body("node-a"))
    publish(
        producer,
        topic,
        [batch("node-a", s, [fake_hash(i, s) for i in range(32)]) for s in range(1, 4)],
    )
    converge(a.client, b.client, keys=96)
    positions = stats(a.client)["kafka_positions"]
    a.stop()
    publish(
        producer,
        topic,
        [batch("node-a", s, [fake_hash(i, s) for i in range(32)]) for s in range(4, 7)],
    )
    a2 = start_coordinator(**kafka_cfg(kafka_broker, topic, snapshot_path=snap))
    a2.wait_ready()
    converge(a2.client, b.client, keys=192)
    later = stats(a2.client)["kafka_positions"]
    assert all(later[k] >= v for k, v in positions.items())
    # resumed, not replayed: nothing counted as duplicate
    assert 'outcome="duplicate"' not in a2.client.get("/metrics").text
    assert [i["instance_id"] for i in a2.client.get("/instances").json()["instances"]] == ["node-a"]


def snapshot_positions(path: Path) -> dict[str, int]:
    """The Kafka positions stored in a snapshot file (none when there is no file)."""
    if not path.exists():
        return {}
    _, positions = FleetState.restore(unframe(path.read_bytes()))
    return positions


_RECORDS = re.compile(r"^kvatlas_coordinator_kafka_records_total\{.*\} (\S+)$", re.M)


def records_consumed(client: httpx.Client) -> int:
    """Kafka records this coordinator process consumed since it started, of any kind."""
    return int(sum(float(v) for v in _RECORDS.findall(client.get("/metrics").text)))


@pytest.mark.slow
def test_kill_9_replica_restores_and_replays_to_the_same_digest(
    kafka_broker: Any, topic: str, producer: Any, start_coordinator: Start, tmp_path: Path
) -> None:
    snap = tmp_path / "p.snap"
    args = (
        "--event-transport", "kafka", "--kafka-bootstrap-servers", kafka_broker.bootstrap,
        "--kafka-topic", topic, "--snapshot-path", str(snap), "--snapshot-interval", "0.2",
    )  # fmt: skip
    b = start_coordinator(**kafka_cfg(kafka_broker, topic))
    with start_coordinator_process(*args, log=tmp_path / "p.log") as p:
        p.wait_http("/readyz")
        client = httpx.Client(base_url=p.url, timeout=30)
        client.post("/instances", json=register_body("node-a"))
        publish(
            producer,
            topic,
            [batch("node-a", s, [fake_hash(i, s) for i in range(50)]) for s in range(1, 11)],
        )
        converge(client, b.client, keys=500)
        consumed = stats(client)["kafka_positions"]
        wait_until(
            lambda: snapshot_positions(snap),
            lambda stored: stored == consumed,
            what=f"a snapshot of the state at positions {consumed}",
        )
        # more records after that snapshot: the restart must replay them (the gate
        # absorbs whatever a later snapshot had already applied)
        publish(
            producer,
            topic,
            [batch("node-a", s, [fake_hash(i, s) for i in range(50)]) for s in range(11, 13)],
        )
        p.kill()
        client.close()
    publish(producer, topic, [batch("node-a", 13, [fake_hash(i, 13) for i in range(50)])])
    restored = snapshot_positions(snap)
    # the snapshot holds at least the registration and the first ten batches
    assert all(restored[k] >= v for k, v in consumed.items()) and sum(consumed.values()) >= 11
    with start_coordinator_process(*args, log=tmp_path / "p2.log") as p2:
        p2.wait_http("/readyz")
        client = httpx.Client(base_url=p2.url, timeout=30)
        converge(client, b.client, keys=650)
        end = stats(client)["kafka_positions"]
        # It started from its snapshot: it consumed only the records after the stored
        # positions (a full replay reaches the same digest, but reads all of them).
        after_snapshot = sum(end[k] - restored.get(k, 0) for k in end)
        assert records_consumed(client) == after_snapshot < sum(end.values())
        client.close()
    assert "Restored snapshot" in p2.text()


def test_a_replica_not_caught_up_answers_heartbeats_503_not_404(
    kafka_broker: Any, start_coordinator: Start
) -> None:
    """Until it has read the log, a replica cannot tell "unknown" from "not read yet": a
    404 would send a live server into a needless re-registration and resync, a 503
    sends it to another replica (or back later)."""
    topic = f"events-{uuid.uuid4().hex[:8]}"  # not created yet: the replica waits for it
    rc = start_coordinator(**kafka_cfg(kafka_broker, topic))
    r = rc.client.put("/instances/node-a/heartbeat")
    assert r.status_code == 503 and "not caught up" in r.json()["error"], r.text
    kafka_broker.create_topic(topic, partitions=8)
    rc.wait_ready()
    assert rc.client.put("/instances/node-a/heartbeat").status_code == 404
