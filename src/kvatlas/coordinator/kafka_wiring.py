"""Wiring of the Kafka parts (kept apart because confluent-kafka is optional).

Owns nothing but the construction of the replicated membership frontend and the
consumer that feeds it, in the order they depend on each other.
"""

from __future__ import annotations

from collections.abc import Callable

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.kafka_ingest import KafkaIngest
from kvatlas.coordinator.kafka_membership import LogMembership
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.service import CoordinatorService


def build_kafka(
    config: CoordinatorConfig,
    service: CoordinatorService,
    metrics: CoordinatorMetrics,
    clock: Callable[[], float],
) -> tuple[LogMembership, list[LogMembership | KafkaIngest]]:
    """The membership frontend and the parts to start (in order) and stop (reversed)."""
    membership = LogMembership(config, service, clock)
    ingest = KafkaIngest(config, service, metrics, membership.apply, clock)
    return membership, [membership, ingest]
