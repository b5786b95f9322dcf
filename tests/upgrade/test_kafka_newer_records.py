"""A coordinator reading the topic after some writers were upgraded past it (real tansu
broker): a batch record of a newer version is skipped after the gate (its seq is no
gap), a membership record of a newer format or type is skipped and counted ``unknown``,
and the partition goes on to the records after them."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from confluent_kafka import Producer

from coordinator.events import batch, fake_hash
from coordinator.test_kafka import kafka_cfg, stats
from kvatlas.wire.kafka_records import MAGIC, RECORD_VERSION, encode_batch_msgpack
from support.coordinator import RunningCoordinator
from support.wait import wait_until

pytestmark = [pytest.mark.kafka]


def test_newer_records_are_skipped_and_the_rest_applied(
    kafka_broker: Any, start_coordinator: Callable[..., RunningCoordinator]
) -> None:
    topic = f"events-newer-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=1)
    producer = Producer({"bootstrap.servers": kafka_broker.bootstrap, "linger.ms": 2})
    newer = msgspec.msgpack.decode(encode_batch_msgpack(batch("node-x", 2, [fake_hash(2)])))
    newer["v"] = RECORD_VERSION + 1
    for value in (
        encode_batch_msgpack(batch("node-x", 1, [fake_hash(1)])),
        msgspec.msgpack.encode(newer),
        b"KVM2" + msgspec.msgpack.encode({"type": "heartbeat"}),
        MAGIC + msgspec.msgpack.encode({"type": "lease_transfer", "at": 1.0}),
        encode_batch_msgpack(batch("node-x", 3, [fake_hash(3)])),
    ):
        producer.produce(topic, key="node-x", value=value)
    assert producer.flush(10) == 0
    a = start_coordinator(**kafka_cfg(kafka_broker, topic))
    a.wait_ready()
    wait_until(lambda: stats(a.client)["keys"], lambda n: n == 2, what="two keys", timeout=15)
    assert [(c["last_seq"], c["gaps"]) for c in stats(a.client)["cursors"]] == [(3, 0)]
    m = a.client.get("/metrics").text
    skipped = f'event_type="store@v{RECORD_VERSION + 1}",transport="kafka"'
    assert f"kvatlas_coordinator_skipped_batches_total{{{skipped}}} 1.0" in m
    assert 'kvatlas_coordinator_kafka_records_total{kind="unknown"} 2.0' in m
    assert 'kvatlas_coordinator_kafka_records_total{kind="undecodable"}' not in m
