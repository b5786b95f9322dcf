"""Event sinks: where the publisher's batches go (HTTP POST /events, or Kafka).

Owns the transport of already-cut batches; one interface, two backends. ``send`` either
delivers every batch it was given (in order) or raises SinkError, in which case the
publisher keeps them all and sends them again later with the same seqs: the coordinator's
gate drops any that did arrive as duplicates. It returns how many of them the receiver
answered as duplicate or stale (0 where it cannot tell: a log), so that the publisher can
tell a resend's expected duplicates from batches it never sent before. A sink must not
buffer, reorder, retry on its own or assign seqs; that is the publisher's job. The HTTP
sink sends through the process's `CoordinatorClient` and does not close it (its owner
does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from kvatlas.core.events import EventBatch
from kvatlas.runtime.coordinator_client import CoordinatorClient, CoordinatorError
from kvatlas.runtime.extras import needs_extra
from kvatlas.server.errors import SinkError
from kvatlas.wire.events_api import EventFormat, compact_batch
from kvatlas.wire.kafka_records import DEFAULT_PARTITIONER, PROOF_HEADER, encode_batch_msgpack

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Delivers batches, all or nothing from the caller's point of view."""

    name: str

    def send(self, batches: list[EventBatch]) -> int:
        """Deliver ``batches`` in order; raise SinkError when not all are known delivered.
        Returns how many the receiver answered as duplicate or stale (0: none, or it
        cannot tell)."""
        ...

    def close(self) -> None: ...


class HttpSink:
    """``POST /events`` of the coordinator with msgpack (default; each batch as a key
    block where `compact_batch` can make one) or JSON bodies."""

    name = "http"

    def __init__(self, coordinator: CoordinatorClient, fmt: EventFormat = "msgpack") -> None:
        self._coordinator = coordinator
        self._fmt = fmt

    def send(self, batches: list[EventBatch]) -> int:
        try:
            answer = self._coordinator.post_events(batches, self._fmt)
        except CoordinatorError as exc:
            raise SinkError(str(exc)) from exc
        return answer.duplicates + answer.stale

    def close(self) -> None:
        """Nothing of its own to release: the client is its owner's to close."""


class KafkaSink:
    """One Kafka record per batch: key = instance id, value = msgpack of the core batch
    (as a key block where `compact_batch` can make one).

    Keyed by instance id so each emitter's order holds within its partition; the
    partitioner must be the coordinators' (``wire.kafka_records.DEFAULT_PARTITIONER``
    on both sides unless configured), so that an instance's membership records land in
    the same partition. ``send`` waits for every record's delivery report (bounded by
    ``timeout_s``). ``proof`` gives the instance's proof at each send (the hex digest of
    its secret, "" for none), carried in the ``PROOF_HEADER`` record header.
    """

    name = "kafka"

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        timeout_s: float = 10.0,
        *,
        partitioner: str = DEFAULT_PARTITIONER,
        proof: Callable[[], str] | None = None,
        **extra: Any,
    ) -> None:
        with needs_extra("kafka", "--event-transport kafka"):
            from confluent_kafka import Producer  # noqa: PLC0415  # optional: the kafka extra

        self._topic = topic
        self._timeout_s = timeout_s
        self._proof = proof
        conf: dict[str, Any] = {
            "bootstrap.servers": bootstrap_servers,
            "partitioner": partitioner,
            "linger.ms": 5,
            "acks": "all",
            "message.timeout.ms": int(timeout_s * 1000),
            "max.in.flight.requests.per.connection": 1,
        }
        conf.update(extra)
        self._producer = Producer(conf)

    def send(self, batches: list[EventBatch]) -> int:
        """Returns 0: a log takes every record; the coordinators' gates judge them later."""
        errors: list[str] = []

        def on_delivery(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        proof = self._proof() if self._proof is not None else ""
        headers: list[tuple[str, str | bytes | None]] | None = (
            [(PROOF_HEADER, proof)] if proof else None
        )
        try:
            for b in batches:
                self._producer.produce(
                    self._topic,
                    key=b.instance_id.encode(),
                    value=encode_batch_msgpack(compact_batch(b)),
                    headers=headers,
                    on_delivery=on_delivery,
                )
                self._producer.poll(0)
            remaining = self._producer.flush(self._timeout_s)
        except (BufferError, RuntimeError) as exc:
            self._producer.flush(self._timeout_s)
            raise SinkError(f"Kafka produce to {self._topic!r} failed: {exc!r}") from exc
        except Exception as exc:  # KafkaException derives from Exception only
            raise SinkError(f"Kafka produce to {self._topic!r} failed: {exc!r}") from exc
        if remaining:
            raise SinkError(f"Kafka: {remaining} records to {self._topic!r} not delivered in time")
        if errors:
            raise SinkError(f"Kafka delivery to {self._topic!r} failed: {errors[0]}")
        return 0

    def close(self) -> None:
        self._producer.flush(self._timeout_s)
