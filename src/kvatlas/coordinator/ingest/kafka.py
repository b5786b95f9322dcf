"""Kafka consumer of the coordinator: every partition of the topic into the fleet state.

Owns one consumer thread (confluent-kafka). Each coordinator replica assigns itself
EVERY partition of the topic by hand (no consumer group, no rebalancing, no offsets
committed to the broker): its position per partition is stored with its own snapshot,
changed under the same lock as the state it led to, so a restart resumes exactly there
and the event gate absorbs any overlap. Event batches go to the service's ingest,
membership records to the membership frontend; a record that decodes as neither, or
whose batch of a known type is malformed, is counted and skipped (batches of unknown
event types in a good record are skipped by the service and still move the gate). So is
a batch that its instance's credential (the proof in the ``PROOF_HEADER`` record header)
or the cursor bounds refuse: the log cannot refuse it, so it is skipped, counted as
``refused`` and logged. A well-framed record of a newer writer that this coordinator cannot
read (`wire.kafka_records.UnknownRecord`: a newer membership format or record type) is
skipped and counted as ``unknown``, the first of each kind logged.
Readiness: not ready until every partition has reached the high watermark seen at start
(catch-up).

Must not: decide anything about membership or events itself, or commit offsets to the
broker (a group's committed offsets would be shared between replicas).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.state.fleet import Position
from kvatlas.core.errors import CredentialRefused, InvalidInput, OutOfBounds, Unauthenticated
from kvatlas.wire.kafka_records import (
    MembershipRecord,
    UnknownRecord,
    decode_proof,
    decode_record,
)

log = logging.getLogger(__name__)

_BATCH = 512
_POLL_S = 0.1
_LAG_EVERY_S = 1.0
_MAX_LOGGED_UNKNOWN = 32
"""Kinds of unknown records logged (once each); later kinds are only counted."""

OnMembership = Callable[[MembershipRecord, Position], None]


def position_key(topic: str, partition: int) -> str:
    return f"kafka:{topic}:{partition}"


class KafkaIngest:
    """The consumer thread."""

    def __init__(
        self,
        config: CoordinatorConfig,
        service: CoordinatorService,
        metrics: CoordinatorMetrics,
        on_membership: OnMembership,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._cfg = config
        self._svc = service
        self._metrics = metrics
        self._on_membership = on_membership
        self._clock = clock
        self._topic = config.kafka_topic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._targets: dict[int, int] = {}
        self._unknown: set[str] = set()
        """Kinds of unknown records logged already."""
        self.caught_up_after_s: float | None = None
        """Seconds from start to the end of catch-up (for logs and benchmarks)."""

    def start(self) -> None:
        self._svc.readiness.set_not_ready(f"catching up on Kafka topic {self._topic}")
        self._thread = threading.Thread(target=self._run, name="kafka-ingest", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _consumer(self) -> Consumer:
        return Consumer(
            {
                "bootstrap.servers": self._cfg.kafka_bootstrap_servers,
                # librdkafka needs a group id even with manual assignment; nothing is
                # committed under it, so replicas never share positions.
                "group.id": "kvatlas-coordinator",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": 50,
                "queued.max.messages.kbytes": 262144,
            }
        )

    def _partitions(self, consumer: Consumer) -> list[int]:
        """The topic's partitions; waits (not ready) until the topic exists."""
        while not self._stop.is_set():
            try:
                md = consumer.list_topics(self._topic, timeout=5)
                topic = md.topics.get(self._topic)
                if topic is not None and topic.error is None and topic.partitions:
                    return sorted(topic.partitions)
            except KafkaException as exc:
                log.warning("Kafka metadata for %s unavailable: %s", self._topic, exc)
            self._svc.readiness.set_not_ready(f"waiting for Kafka topic {self._topic}")
            self._stop.wait(1.0)
        return []

    def _run(self) -> None:
        started = time.perf_counter()
        consumer = self._consumer()
        try:
            partitions = self._partitions(consumer)
            if not partitions:
                return
            stored = dict(self._svc.state.positions)
            assignment = []
            for p in partitions:
                offset = stored.get(position_key(self._topic, p), OFFSET_BEGINNING)
                assignment.append(TopicPartition(self._topic, p, offset))
            consumer.assign(assignment)
            for p in partitions:
                _low, high = consumer.get_watermark_offsets(
                    TopicPartition(self._topic, p), timeout=10
                )
                self._targets[p] = high
                at = stored.get(position_key(self._topic, p))
                if at is not None and at > high:
                    log.warning(
                        "Stored position %d of partition %d is past the high watermark %d"
                        " (the broker lost the topic?); reading from the start",
                        at,
                        p,
                        high,
                    )
            log.info(
                "Consuming Kafka topic %s, partitions %s, from %s",
                self._topic,
                partitions,
                {p: stored.get(position_key(self._topic, p), "start") for p in partitions},
            )
            self._loop(consumer, partitions, started)
        finally:
            consumer.close()

    def _caught_up(self) -> bool:
        pos = self._svc.state.positions
        for p, high in self._targets.items():
            at = pos.get(position_key(self._topic, p), 0)
            if at < high and high > 0:
                return False
        return True

    def _loop(self, consumer: Consumer, partitions: list[int], started: float) -> None:
        next_lag = 0.0
        while not self._stop.is_set():
            msgs = consumer.consume(num_messages=_BATCH, timeout=_POLL_S)
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        log.warning("Kafka consume error: %s", err)
                    continue
                partition, offset = msg.partition(), msg.offset()
                assert partition is not None and offset is not None
                headers = msg.headers()
                self._handle(
                    partition,
                    offset,
                    msg.value(),
                    msg.timestamp(),
                    headers if isinstance(headers, list) else None,
                )
            # Caught up: every partition reached the high watermark seen at start, and a
            # fetch came back empty (tansu reports the base offset of a partition's last
            # record batch + 1 as its high watermark, so the watermark alone is early).
            if not msgs and not self._svc.readiness.ready and self._caught_up():
                self.caught_up_after_s = time.perf_counter() - started
                log.info(
                    "Caught up on Kafka topic %s in %.2f s", self._topic, self.caught_up_after_s
                )
                self._svc.readiness.set_ready()
            now = time.monotonic()
            if now >= next_lag:
                next_lag = now + _LAG_EVERY_S
                self._update_lag(consumer, partitions)

    def _update_lag(self, consumer: Consumer, partitions: list[int]) -> None:
        pos = self._svc.state.positions
        for p in partitions:
            try:
                _, high = consumer.get_watermark_offsets(
                    TopicPartition(self._topic, p), timeout=0.5, cached=False
                )
            except KafkaException:
                continue
            at = pos.get(position_key(self._topic, p), 0)
            self._metrics.kafka_lag.labels(str(p)).set(max(0, high - at))

    def _handle(
        self,
        partition: int,
        offset: int,
        value: bytes | None,
        timestamp: tuple[int, int],
        headers: list[tuple[str, str | bytes | None]] | None = None,
    ) -> None:
        position = (position_key(self._topic, partition), offset + 1)
        ts_type, ts_ms = timestamp
        # The record's timestamp, not this process's clock: every replica must apply a
        # record at the same time (provisional instances expire by it).
        now = ts_ms / 1000.0 if ts_type != 0 and ts_ms > 0 else self._clock()
        try:
            if value is None:
                raise InvalidInput("empty record")
            record = decode_record(value, self._cfg.max_batch_entries)
            if isinstance(record, list):
                proof = decode_proof(headers)
                self._svc.ingest.apply(
                    record, now, transport="kafka", position=position, proof=proof
                )
                self._metrics.kafka_records.labels("batch").inc()
            elif isinstance(record, UnknownRecord):
                self._metrics.kafka_records.labels("unknown").inc()
                if record.what not in self._unknown and len(self._unknown) < _MAX_LOGGED_UNKNOWN:
                    self._unknown.add(record.what)
                    log.warning(
                        "Skipped a record this coordinator cannot read (%s, a newer writer's?)"
                        " at partition %d offset %d; later ones of its kind are skipped"
                        " silently",
                        record.what,
                        partition,
                        offset,
                    )
                self._svc.state.advance(position)
            else:
                self._on_membership(record, position)
                self._metrics.kafka_records.labels("membership").inc()
        except (Unauthenticated, CredentialRefused, OutOfBounds):
            # Logged and counted by the service, which also moved the position past it.
            self._metrics.kafka_records.labels("refused").inc()
        except InvalidInput as exc:
            self._metrics.kafka_records.labels("undecodable").inc()
            log.warning(
                "Skipped undecodable record at partition %d offset %d: %s", partition, offset, exc
            )
            self._svc.state.advance(position)
