"""`kvatlas coordinator`: flags and environment -> CoordinatorConfig -> run.

The one place that reads the coordinator's flags and environment (`KVATLAS_AUTH_TOKEN`,
through `cli.auth_flags`).
Must not contain coordinator logic: validation lives in the config, wiring in
`kvatlas.coordinator.app`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib

from kvatlas.cli.auth_flags import (
    add_operator_token_flag,
    add_token_flags,
    read_operator_token,
    read_token,
)
from kvatlas.cli.log_setup import configure_logging
from kvatlas.coordinator.app import Coordinator
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.vllm.sources import parse_sources
from kvatlas.core.errors import ConfigError
from kvatlas.core.tenancy import TenantTable

_D = CoordinatorConfig()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvatlas coordinator",
        description="The fleet's control plane: membership, cache events, key directory.",
    )
    a = p.add_argument
    a("--host", default=_D.host, help="address to bind (default %(default)s)")
    a("--port", type=int, default=_D.port, help="HTTP port (default %(default)s)")
    a(
        "--instance-timeout",
        type=float,
        default=_D.instance_timeout,
        help="seconds without heartbeat before an instance expires (default %(default)s)",
    )
    a(
        "--health-check-interval",
        type=float,
        default=_D.health_check_interval,
        help="seconds between expiry sweeps (default %(default)s)",
    )
    a(
        "--chunk-size",
        type=int,
        default=_D.chunk_size,
        help="tokens per chunk (default %(default)s)",
    )
    a(
        "--enable-blend-lookup",
        action="store_true",
        help="index chunk tokens and serve POST /directory/blend-lookup",
    )
    a(
        "--drop-token-ids",
        action="store_true",
        help="do not keep the token ids senders send with STORE (lookups answer [])",
    )
    a(
        "--event-transport",
        choices=["http", "kafka"],
        default=_D.event_transport,
        help="where events and membership come from (default %(default)s)",
    )
    a(
        "--kafka-bootstrap-servers",
        default=_D.kafka_bootstrap_servers,
        help="Kafka bootstrap servers host:port[,host:port]",
    )
    a("--kafka-topic", default=_D.kafka_topic, help="Kafka topic (default %(default)s)")
    a(
        "--kafka-partitioner",
        default=_D.kafka_partitioner,
        help="librdkafka partitioner for membership records; must match the servers' event"
        " sinks (default %(default)s)",
    )
    a(
        "--l2-retention-s",
        type=float,
        default=_D.l2_retention_s,
        help="seconds the L2 placements of an instance that is gone stay for it to come"
        " back; 0 drops them with its L1 slice (default %(default)s)",
    )
    a("--snapshot-path", default=_D.snapshot_path, help="snapshot file (default: none)")
    a(
        "--snapshot-interval",
        type=float,
        default=_D.snapshot_interval,
        help="seconds between snapshots, 0 = only at shutdown (default %(default)s)",
    )
    add_token_flags(
        p,
        "the shared bearer token, which admits a client (no token: no auth); speaking for"
        " an instance that registered with a credential also needs that instance's secret",
    )
    add_operator_token_flag(p)
    a(
        "--tenants",
        default="",
        metavar="FILE",
        help="the router's tenants file (TOML, the same as `kvatlas router --tenants`):"
        " the fleet page names each cache_salt's row after its tenant (tenant:ID,"
        " shared:NAME) for the operator (default: none, salts shown as they are)",
    )
    a(
        "--require-instance-credentials",
        action="store_true",
        help="refuse instances that register without asking for a secret (LMCache's servers"
        " do not ask; without this flag they are accepted unbound)",
    )
    a(
        "--max-seq-jump",
        type=int,
        default=_D.max_seq_jump,
        help="most seqs one event batch may move an instance's cursor forward; further is"
        " refused (default %(default)s)",
    )
    a(
        "--max-incarnation-ahead-s",
        type=float,
        default=_D.max_incarnation_ahead_s,
        help="seconds an incarnation may be ahead of this coordinator's clock; further is"
        " refused (default %(default)s)",
    )
    a(
        "--max-body-bytes",
        type=int,
        default=_D.max_body_bytes,
        help="largest request body (default %(default)s)",
    )
    a(
        "--max-batch-entries",
        type=int,
        default=_D.max_batch_entries,
        help="most entries per event batch (default %(default)s)",
    )
    a(
        "--max-lookup-tokens",
        type=int,
        default=_D.max_lookup_tokens,
        help="most tokens per lookup (default %(default)s)",
    )
    a(
        "--token-hash-memo-bytes",
        type=int,
        default=_D.token_hash_memo_bytes,
        help="memory for recent links of the token hash chain, so that a prompt looked"
        " up again is not hashed again; 0: none (default %(default)s)",
    )
    a(
        "--vllm-kv-events",
        action="append",
        default=None,
        metavar="ENGINE=tcp://HOST:PORT[,replay=tcp://HOST:PORT,...]",
        help="subscribe to a vLLM engine's KV events (its --kv-events-config endpoint) and"
        " index its prefix cache as the device tier; options: replay=, topic=, dp_size=,"
        " block_size= (16), hash= (sha256), seed= (vllm-none-hash), url= (its OpenAI URL,"
        " for routers); repeat per engine",
    )
    a(
        "--vllm-kv-events-from-members",
        action="store_true",
        help="also subscribe to the vLLM KV event sources registered servers advertise"
        " (their --engine-kv-events), dropping them when the server leaves",
    )
    a(
        "--kv-indexer-api",
        action="store_true",
        help="serve the Mooncake KV Indexer RFC routes as NVIDIA Dynamo's standalone indexer"
        " does (/register, /unregister, /workers, /query, /query_by_hash, /dump): vLLM"
        " workers registered there feed the device tier; kept beside --snapshot-path",
    )
    a(
        "--cpu-latency-us",
        type=int,
        default=None,
        metavar="US",
        help="while serving, hold this machine's CPUs to waking within US microseconds"
        " (/dev/cpu_dma_latency, needs root); 0 keeps idle CPUs polling instead of"
        " halting, for the lowest lookup tail on VMs whose halted vCPUs wake late, at the"
        " price of idle CPUs spinning (default: no hold)",
    )
    a(
        "--max-lookup-keys",
        type=int,
        default=_D.max_lookup_keys,
        help="most keys per lookup (default %(default)s)",
    )
    a(
        "--max-connections",
        type=int,
        default=_D.max_connections,
        help="most open HTTP connections; more get 503 (default: 4096, or fewer when"
        " ulimit -n leaves no room)",
    )
    a(
        "--max-buffered-bytes",
        type=int,
        default=_D.max_buffered_bytes,
        help="most request body bytes held at once across all connections; a body over"
        " 64 KiB that does not fit gets 503 (default %(default)s, at least --max-body-bytes)",
    )
    a(
        "--header-timeout-s",
        type=float,
        default=_D.header_timeout_s,
        help="seconds a request's line and headers may take from its first byte; slower"
        " gets 408 (default %(default)s)",
    )
    a(
        "--body-timeout-s",
        type=float,
        default=_D.body_timeout_s,
        help="window over which a body must arrive at --min-body-rate (default %(default)s)",
    )
    a(
        "--min-body-rate",
        type=float,
        default=_D.min_body_rate,
        help="bytes/s a body must arrive at in every --body-timeout-s window; slower gets"
        " 408 (default %(default)s)",
    )
    a(
        "--eviction-check-interval",
        type=float,
        default=_D.eviction_check_interval,
        help="seconds between sweeps of the fleet L2 eviction loop that keeps each"
        " cache_salt under its quota; 0: no loop (default %(default)s)",
    )
    a(
        "--eviction-ratio",
        type=float,
        default=_D.eviction_ratio,
        help="fraction of an over-quota salt's L2 keys one sweep evicts, least recently"
        " used first (default %(default)s)",
    )
    a(
        "--trigger-watermark",
        type=float,
        default=_D.trigger_watermark,
        help="a salt is over quota at this fraction of its limit (default %(default)s)",
    )
    a("--log-level", default=_D.log_level, help="logging level (default %(default)s)")
    return p


def config_from_args(argv: list[str] | None, environ: dict[str, str]) -> CoordinatorConfig:
    ns = build_parser().parse_args(argv)
    token = read_token(ns, environ)
    return CoordinatorConfig(
        host=ns.host,
        port=ns.port,
        instance_timeout=ns.instance_timeout,
        health_check_interval=ns.health_check_interval,
        chunk_size=ns.chunk_size,
        enable_blend_lookup=ns.enable_blend_lookup,
        drop_token_ids=ns.drop_token_ids,
        event_transport=ns.event_transport,
        kafka_bootstrap_servers=ns.kafka_bootstrap_servers,
        kafka_topic=ns.kafka_topic,
        kafka_partitioner=ns.kafka_partitioner,
        l2_retention_s=ns.l2_retention_s,
        snapshot_path=ns.snapshot_path,
        snapshot_interval=ns.snapshot_interval,
        auth_token=token,
        operator_token=read_operator_token(ns, environ),
        tenant_names=read_tenant_names(ns.tenants),
        require_instance_credentials=ns.require_instance_credentials,
        max_seq_jump=ns.max_seq_jump,
        max_incarnation_ahead_s=ns.max_incarnation_ahead_s,
        max_body_bytes=ns.max_body_bytes,
        max_batch_entries=ns.max_batch_entries,
        max_lookup_tokens=ns.max_lookup_tokens,
        token_hash_memo_bytes=ns.token_hash_memo_bytes,
        cpu_latency_us=ns.cpu_latency_us,
        max_lookup_keys=ns.max_lookup_keys,
        max_connections=ns.max_connections,
        max_buffered_bytes=ns.max_buffered_bytes,
        header_timeout_s=ns.header_timeout_s,
        body_timeout_s=ns.body_timeout_s,
        min_body_rate=ns.min_body_rate,
        eviction_check_interval=ns.eviction_check_interval,
        eviction_ratio=ns.eviction_ratio,
        trigger_watermark=ns.trigger_watermark,
        log_level=ns.log_level.upper(),
        vllm_kv_events=parse_sources(ns.vllm_kv_events),
        vllm_kv_events_from_members=ns.vllm_kv_events_from_members,
        kv_indexer_api=ns.kv_indexer_api,
    )


def read_tenant_names(path: str) -> tuple[tuple[str, str], ...]:
    """``(cache_salt, tenant:ID | shared:NAME)`` of every salt the tenants file derives
    (none without a file); ConfigError naming `--tenants` when it cannot be read or is
    not a valid tenants document."""
    if not path:
        return ()
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--tenants {path} cannot be read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--tenants {path} is not valid TOML: {exc}") from exc
    table = TenantTable.from_document(doc, source=f"--tenants {path}")
    return tuple(sorted((salt, name) for name, salt in table.salts().items()))


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv, dict(os.environ))
    except ConfigError as exc:
        print(f"kvatlas coordinator: {exc}", file=sys.stderr)
        return 2
    if not configure_logging("kvatlas coordinator", config.log_level):
        return 2
    try:
        coordinator = Coordinator(config)
        coordinator.bind()
    except ConfigError as exc:
        print(f"kvatlas coordinator: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"kvatlas coordinator: cannot listen on --host {config.host} --port {config.port}:"
            f" {exc}",
            file=sys.stderr,
        )
        return 2
    coordinator.run()
    # Non-zero so that a supervisor notices that a restart loses state (logged above).
    return 1 if coordinator.final_snapshot_failed else 0


if __name__ == "__main__":
    sys.exit(main())
