"""Wiring of the Kafka parts (kept apart because confluent-kafka is optional).

Owns nothing but the construction of the replicated membership frontend and the
consumer that feeds it, in the order they depend on each other.
"""

from __future__ import annotations

from collections.abc import Callable

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.ingest.kafka import KafkaIngest
from kvatlas.coordinator.ingest.kafka_membership import LogMembership
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.quota.controller import QuotaController
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.state.fleet import Position
from kvatlas.core.coordinator.quotas import OperatorOp, OpResult


def build_kafka(
    config: CoordinatorConfig,
    service: CoordinatorService,
    metrics: CoordinatorMetrics,
    clock: Callable[[], float],
    quotas: QuotaController | None = None,
) -> tuple[LogMembership, list[LogMembership | KafkaIngest]]:
    """The membership frontend (also the quota controller's operator log) and the parts
    to start (in order) and stop (reversed)."""

    def on_operator(op: OperatorOp, position: Position) -> OpResult:
        assert quotas is not None
        return quotas.apply(op, position, transport="kafka")

    membership = LogMembership(config, service, clock, on_operator if quotas is not None else None)
    ingest = KafkaIngest(config, service, metrics, membership.apply, clock)
    return membership, [membership, ingest]
