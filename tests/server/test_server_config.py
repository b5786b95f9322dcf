"""`kvatlas server`'s Kafka flags: the same defaults as the coordinator's, because an
instance's event batches and the coordinators' membership records of it must share a
topic and a partitioner to stay in one partition, in order. Also the flags that reach
the config and the ranges it refuses naming the flag (coordinator URLs, the P2P
directory timeout, the engine API's queue bounds, the advertised ip, the L1 tenant
share)."""

from __future__ import annotations

import pytest

from kvatlas.cli.coordinator import config_from_args as coordinator_config
from kvatlas.cli.server import build_parser, config_from_args
from kvatlas.core.errors import ConfigError
from kvatlas.core.types import InstanceId
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
        InstanceId("node-a"),
        events=EventConfig(transport="kafka", kafka=KafkaConfig("h:1", partitioner="")),
    )
    with pytest.raises(ConfigError, match="--kafka-partitioner"):
        config.validate()


def urls_of(*flags: str) -> tuple[str, ...]:
    args = build_parser().parse_args(["--instance-id", "node-a", *flags])
    return config_from_args(args, {}).coordinator.urls


def test_coordinator_urls_repeat_or_separate_by_commas_in_order() -> None:
    a, b, c = (f"http://10.0.0.{i}:9300" for i in (1, 2, 3))
    assert urls_of() == ()
    assert urls_of("--coordinator-url", a) == (a,)
    assert urls_of("--coordinator-url", f"{a},{b}", "--coordinator-url", c) == (a, b, c)
    assert urls_of("--coordinator-url", f" {b} , {a},") == (b, a)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("10.0.0.1:9300", "must start with http:// or https://, got '10.0.0.1:9300'"),
        ("http://h:1,http://h:1/", "--coordinator-url names http://h:1 more than once"),
    ],
)
def test_bad_coordinator_urls_are_refused_naming_the_flag(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        urls_of("--coordinator-url", value)


def test_directory_timeout_flag_reaches_the_config_and_must_be_positive() -> None:
    p2p = ["--p2p-advertise-url", "127.0.0.1:9400"]
    args = build_parser().parse_args([*KAFKA, *p2p, "--p2p-directory-timeout", "0.2"])
    assert config_from_args(args, {}).p2p.directory_timeout_s == 0.2
    args = build_parser().parse_args([*KAFKA, *p2p, "--p2p-directory-timeout", "0"])
    with pytest.raises(ConfigError, match="--p2p-directory-timeout"):
        config_from_args(args, {}).validate()


def test_engine_queue_bounds_reach_the_config_and_are_refused_out_of_range() -> None:
    flags = ["--engine-max-queued", "16", "--engine-max-queued-per-client", "4"]
    config = config_from_args(build_parser().parse_args([*KAFKA, *flags]), {})
    assert (config.engine_max_queued, config.engine_max_queued_per_client) == (16, 4)
    for bad, flag in (
        (["--engine-max-queued", "0"], "--engine-max-queued must"),
        (["--engine-max-queued-per-client", "0"], "--engine-max-queued-per-client must"),
        ([*flags[:2], "--engine-max-queued-per-client", "17"], "per-client must be in"),
    ):
        args = build_parser().parse_args([*KAFKA, *bad])
        with pytest.raises(ConfigError, match=flag):
            config_from_args(args, {}).validate()


def test_an_empty_advertise_ip_is_refused_naming_the_flag() -> None:
    """The coordinator refuses a registration without an ip (as LMCache's does): the
    server says so at start, naming its flag, rather than failing every registration."""
    with pytest.raises(ConfigError, match="--coordinator-advertise-ip must not be empty"):
        urls_of("--coordinator-url", "http://h:1", "--coordinator-advertise-ip", " ")
    assert urls_of("--coordinator-advertise-ip", "") == ()  # alone: nothing to register with


def test_tenant_min_share_reaches_the_config_and_must_be_a_fraction() -> None:
    base = ["--instance-id", "node-a"]
    assert config_from_args(build_parser().parse_args(base), {}).l1.tenant_min_share == 0.0
    args = build_parser().parse_args([*base, "--l1-tenant-min-share", "0.25"])
    assert config_from_args(args, {}).l1.tenant_min_share == 0.25
    for bad in ("-0.1", "1.5", "nan"):
        args = build_parser().parse_args([*base, "--l1-tenant-min-share", bad])
        with pytest.raises(ConfigError, match="--l1-tenant-min-share must be a fraction"):
            config_from_args(args, {})
