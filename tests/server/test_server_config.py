"""`kvatlas server`'s Kafka flags: the same defaults as the coordinator's, because an
instance's event batches and the coordinators' membership records of it must share a
topic and a partitioner to stay in one partition, in order."""

from __future__ import annotations

import pytest

from kvatlas.cli.coordinator import config_from_args as coordinator_config
from kvatlas.cli.server import build_parser, config_from_args
from kvatlas.core.errors import ConfigError
from kvatlas.server.config import EventConfig, KafkaConfig, ServerConfig

KAFKA = ["--instance-id", "node-a", "--coordinator-url", "http://127.0.0.1:9300"]


def test_kafka_topic_and_partitioner_default_to_the_coordinators() -> None:
    server = config_from_args(build_parser().parse_args(KAFKA), {}).events.kafka
    coordinator = coordinator_config([], {})
    assert server.topic == coordinator.kafka_topic == "kvatlas-cache-events"
    assert server.partitioner == coordinator.kafka_partitioner == "murmur2_random"


def test_kafka_partitioner_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(
        [*KAFKA, "--event-transport", "kafka", "--kafka-bootstrap-servers", "h:1",
         "--kafka-topic", "events", "--kafka-partitioner", "consistent_random"]
    )  # fmt: skip
    kafka = config_from_args(args, {}).events.kafka
    assert (kafka.topic, kafka.partitioner) == ("events", "consistent_random")


def test_an_empty_partitioner_is_refused_naming_the_flag() -> None:
    config = ServerConfig(
        "node-a",
        events=EventConfig(transport="kafka", kafka=KafkaConfig("h:1", partitioner="")),
    )
    with pytest.raises(ConfigError, match="--kafka-partitioner"):
        config.validate()
