"""The coordinator's configuration: one frozen dataclass and its validation.

Owns the defaults and the operator-facing validation messages (each names the flag to
fix). Must not read flags or the environment (that is `kvatlas.cli.coordinator`'s job,
the one place that does) nor build anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvatlas.coordinator.host.cpu_latency import NO_LIMIT_US
from kvatlas.coordinator.vllm.sources import VllmSource, parse_sources
from kvatlas.core.coordinator.fleet import DEFAULT_L2_RETENTION
from kvatlas.core.credentials import (
    DEFAULT_MAX_INCARNATION_AHEAD_S,
    DEFAULT_MAX_SEQ_JUMP,
    Bounds,
)
from kvatlas.core.errors import ConfigError
from kvatlas.runtime.flag_spec import cli_flag
from kvatlas.wire.kafka_records import DEFAULT_PARTITIONER, DEFAULT_TOPIC

EventTransport = Literal["http", "kafka"]


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything `kvatlas coordinator` can be told: each field is a flag, its docstring the
    flag's help (`kvatlas.cli.flags`)."""

    host: str = "0.0.0.0"
    """Address the HTTP API binds (`--host`)."""
    port: int = 9300
    """TCP port of the HTTP API (`--port`); 0 picks a free one (tests)."""
    instance_timeout: float = field(
        default=30.0, metadata=cli_flag("--instance-timeout-s", compat=("--instance-timeout",))
    )
    """Seconds without a heartbeat after which an instance expires and its L1 slice is
    fenced (`--instance-timeout-s`)."""
    health_check_interval: float = field(
        default=5.0,
        metadata=cli_flag("--health-check-interval-s", compat=("--health-check-interval",)),
    )
    """Seconds between expiry sweeps (`--health-check-interval-s`)."""
    chunk_size: int = 256
    """Tokens per chunk of the fleet's hash contract (`--chunk-size`)."""
    enable_blend_lookup: bool = False
    """Keep chunk tokens and answer `POST /directory/blend-lookup`
    (`--enable-blend-lookup`)."""
    drop_token_ids: bool = False
    """Do not keep the token ids senders send with STORE (`--drop-token-ids`): lookups
    then answer ``token_ids`` [] (unknown). Kept by default, as LMCache's coordinator does; they
    cost 4 bytes per token of the chunks whose senders send them (`token_bytes` in
    /directory/stats), nothing for senders that send none."""
    event_transport: EventTransport = "http"
    """Where cache events and membership come from: `http` (one coordinator) or `kafka`
    (any number of replicas on one topic) (`--event-transport`)."""
    kafka_bootstrap_servers: str = ""
    """Kafka bootstrap servers, `host:port[,host:port]` (`--kafka-bootstrap-servers`)."""
    kafka_topic: str = DEFAULT_TOPIC
    """Topic carrying event batches and membership records (`--kafka-topic`)."""
    kafka_partitioner: str = DEFAULT_PARTITIONER
    """librdkafka partitioner for membership records; it must be the one the servers'
    event sinks use (`--kafka-partitioner` of `kvatlas server`, same default), so that an
    instance's membership records and events share a partition and keep their order
    (`--kafka-partitioner`)."""
    l2_retention_s: float = DEFAULT_L2_RETENTION
    """Seconds the L2 placements of an instance that is gone (deregistered or expired)
    stay in the directory for it to come back, after which they are dropped
    (`--l2-retention-s`); 0 drops them with its L1 slice. An instance that never
    registered loses every placement when it expires, whatever this says."""
    snapshot_path: str = ""
    """File the state is snapshotted to and restored from; empty: no snapshots
    (`--snapshot-path`)."""
    snapshot_interval: float = field(
        default=60.0,
        metadata=cli_flag("--snapshot-interval-s", deprecated=("--snapshot-interval",)),
    )
    """Seconds between periodic snapshots; 0: only at clean shutdown
    (`--snapshot-interval-s`)."""
    auth_token: str = field(default="", metadata=cli_flag("--auth-token", custom=True))
    """Shared token; when set every endpoint but /healthz needs `Authorization: Bearer
    <token>` (`--auth-token` or `KVATLAS_AUTH_TOKEN`)."""
    require_instance_credentials: bool = False
    """Refuse registrations that do not ask for an instance secret, and events,
    heartbeats and deregistrations without one (`--require-instance-credentials`).
    Off: instances that registered without one (LMCache's servers) are unbound and
    accepted as before; a bound instance always needs its own secret."""
    max_seq_jump: int = DEFAULT_MAX_SEQ_JUMP
    """Most seqs one event batch may move an instance's cursor forward
    (`--max-seq-jump`); further: 400, nothing of the body applied."""
    max_incarnation_ahead_s: float = DEFAULT_MAX_INCARNATION_AHEAD_S
    """Seconds an incarnation (a process start time) may be ahead of this coordinator's
    clock (`--max-incarnation-ahead-s`); further: 400."""
    operator_token: str = field(default="", metadata=cli_flag("--operator-token-file", custom=True))
    """The operator's token (`--operator-token-file` or `KVATLAS_OPERATOR_TOKEN`): when
    set, it admits like the shared token, and only requests bearing it see each
    instance's cursor incarnation and last seq in `/directory/stats` (null for the rest,
    and in the fleet page's document)."""
    tenant_names: tuple[tuple[str, str], ...] = field(
        default=(), metadata=cli_flag("--tenants", custom=True)
    )
    """``(cache_salt, what it belongs to)`` pairs, ``tenant:ID`` or ``shared:NAME``, derived
    from the router's tenants file (`--tenants`, read by `kvatlas.cli.coordinator`): the
    fleet page labels each salt's row with its tenant, for the operator only; a salt not
    listed shows as itself. Empty: no file, every salt shows as itself."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body accepted (`--max-body-bytes`); larger: 413."""
    max_batch_entries: int = 65536
    """Most entries in one event batch (`--max-batch-entries`); more: 413."""
    max_lookup_tokens: int = 1 << 20
    """Most tokens in one lookup or blend lookup (`--max-lookup-tokens`); more: 413."""
    token_hash_memo_bytes: int = 32 * 1024 * 1024
    """Memory for the memo of recent links of the token hash chain
    (`--token-hash-memo-bytes`): a lookup by tokens whose chunks were looked up before
    (the same prompt asked again while its request waits, a chat's next turn, a shared
    system prompt) takes their hashes from it, compared byte for byte, instead of
    hashing them again, several times faster (`bench.coordinator_bench` measures it;
    docs/benchmarks.md holds the figures). A link is remembered from its second lookup on; one
    takes 64 + 4 * `--chunk-size` bytes (at most this many bytes in all, allocated as it
    fills). 0: no memo. Only where the
    compiled chain was built."""
    max_lookup_keys: int = 65536
    """Most keys in one keys lookup (`--max-lookup-keys`); more: 413."""
    cpu_latency_us: int | None = None
    """While serving, hold this machine's CPUs to waking within this many microseconds
    (`--cpu-latency-us`, the kernel's PM QoS device; needs root). 0 keeps idle CPUs
    polling instead of halting: on VMs whose halted vCPUs now and then wake
    milliseconds late, that keeps the lookup's tail latency from following those late
    wake-ups (`bench.coordinator_bench` compares both), at the price of idle CPUs
    spinning. None: no hold."""
    max_connections: int = 0
    """Most open HTTP connections served at once (`--max-connections`); more are
    answered 503 with Retry-After. 0: 4096, or fewer when the open-file limit
    (`ulimit -n`) leaves no room for them."""
    max_buffered_bytes: int = 256 * 1024 * 1024
    """Most request body bytes held at once across all HTTP connections
    (`--max-buffered-bytes`); a body over 64 KiB reserves its declared length from it
    before it is read, and one that does not fit is answered 503 with Retry-After. At
    least `--max-body-bytes`."""
    header_timeout_s: float = 10.0
    """Seconds from a request's first byte to the end of its headers
    (`--header-timeout-s`); slower: 408 and the connection closed."""
    body_timeout_s: float = 10.0
    """The window over which a body's rate is measured (`--body-timeout-s`): in every
    window from the end of its headers on, a body must arrive at `--min-body-rate`."""
    min_body_rate: float = 16 * 1024
    """Bytes per second a body must arrive at, per window (`--min-body-rate`); slower:
    408 and the connection closed."""
    eviction_check_interval: float = field(
        default=5.0,
        metadata=cli_flag("--eviction-check-interval-s", compat=("--eviction-check-interval",)),
    )
    """Seconds between sweeps of the fleet L2 eviction loop, which keeps each
    ``cache_salt`` under its quota (`--eviction-check-interval-s`); 0: no loop."""
    eviction_ratio: float = 0.2
    """Fraction of an over-quota salt's L2 keys (by count, least recently used first)
    one sweep evicts (`--eviction-ratio`); a quota of 0 evicts them all."""
    trigger_watermark: float = 1.0
    """A salt is over quota when its L2 bytes reach this fraction of its limit
    (`--trigger-watermark`)."""
    log_level: str = "INFO"
    """Python logging level name (`--log-level`)."""
    vllm_kv_events: tuple[VllmSource, ...] = field(
        default=(),
        metadata=cli_flag(
            parse=parse_sources, metavar="ENGINE=tcp://HOST:PORT[,replay=tcp://HOST:PORT,...]"
        ),
    )
    """vLLM engines whose KV events feed the device tier (`--vllm-kv-events`, parsed and
    checked by `kvatlas.coordinator.vllm.sources`): a vLLM engine's `--kv-events-config`
    endpoint, options replay=, topic=, dp_size=, block_size= (16), hash= (sha256), seed=
    (vllm-none-hash), url= (its OpenAI URL, for routers); one per engine."""
    vllm_kv_events_from_members: bool = False
    """Also subscribe to the vLLM KV event sources registered instances advertise
    (``--vllm-kv-events-from-members``; a server's ``--engine-kv-events``), dropping them
    when the server leaves."""
    kv_indexer_api: bool = False
    """Serve the Mooncake KV Indexer RFC routes as NVIDIA Dynamo 1.6.1's standalone
    indexer does (`--kv-indexer-api`: ``/register``, ``/unregister``, ``/workers``,
    ``/query``, ``/query_by_hash``, ``/dump``; `kvatlas.coordinator.indexer.api`): vLLM
    workers registered there feed the device tier, with or without `--vllm-kv-events`.
    Registrations are kept beside the snapshot (`--snapshot-path`)."""

    def validate(self) -> None:
        """Raise ConfigError naming the flag of the first impossible setting."""
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if not self.instance_timeout > 0:
            raise ConfigError(f"--instance-timeout-s must be > 0 s, got {self.instance_timeout}")
        if not self.health_check_interval > 0:
            raise ConfigError(
                f"--health-check-interval-s must be > 0 s, got {self.health_check_interval}"
            )
        if self.health_check_interval > self.instance_timeout:
            raise ConfigError(
                f"--health-check-interval-s ({self.health_check_interval} s) must not exceed"
                f" --instance-timeout-s ({self.instance_timeout} s), or expiry runs late"
            )
        if self.chunk_size <= 0:
            raise ConfigError(f"--chunk-size must be > 0, got {self.chunk_size}")
        if self.drop_token_ids and self.enable_blend_lookup:
            raise ConfigError(
                "--drop-token-ids contradicts --enable-blend-lookup (blend lookup needs them)"
            )
        if self.event_transport not in ("http", "kafka"):
            raise ConfigError(
                f"--event-transport must be http or kafka, got {self.event_transport!r}"
            )
        if self.event_transport == "kafka":
            if not self.kafka_bootstrap_servers:
                raise ConfigError("--event-transport kafka needs --kafka-bootstrap-servers")
            if not self.kafka_topic:
                raise ConfigError("--kafka-topic must not be empty")
        if not self.l2_retention_s >= 0:
            raise ConfigError(f"--l2-retention-s must be >= 0 s, got {self.l2_retention_s}")
        if self.snapshot_interval < 0:
            raise ConfigError(f"--snapshot-interval-s must be >= 0 s, got {self.snapshot_interval}")
        for flag, value in (
            ("--max-body-bytes", self.max_body_bytes),
            ("--max-batch-entries", self.max_batch_entries),
            ("--max-lookup-tokens", self.max_lookup_tokens),
            ("--max-lookup-keys", self.max_lookup_keys),
        ):
            if value <= 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if self.cpu_latency_us is not None and not 0 <= self.cpu_latency_us <= NO_LIMIT_US:
            raise ConfigError(
                f"--cpu-latency-us must be 0-{NO_LIMIT_US} us, got {self.cpu_latency_us}"
            )
        if self.token_hash_memo_bytes < 0:
            raise ConfigError(
                f"--token-hash-memo-bytes must be >= 0 (0: no memo),"
                f" got {self.token_hash_memo_bytes}"
            )
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ConfigError(
                f"--max-buffered-bytes ({self.max_buffered_bytes}) must be at least"
                f" --max-body-bytes ({self.max_body_bytes}), or the largest body is never taken"
            )
        for flag, seconds in (
            ("--header-timeout-s", self.header_timeout_s),
            ("--body-timeout-s", self.body_timeout_s),
            ("--min-body-rate", self.min_body_rate),
        ):
            if not seconds > 0:
                raise ConfigError(f"{flag} must be > 0, got {seconds}")
        if self.max_connections < 0:
            raise ConfigError(
                f"--max-connections must be >= 0 (0: from the open-file limit),"
                f" got {self.max_connections}"
            )
        if self.max_seq_jump <= 0:
            raise ConfigError(f"--max-seq-jump must be > 0, got {self.max_seq_jump}")
        if not self.max_incarnation_ahead_s >= 0:
            raise ConfigError(
                f"--max-incarnation-ahead-s must be >= 0 s, got {self.max_incarnation_ahead_s}"
            )
        if self.operator_token and self.operator_token != self.operator_token.strip():
            raise ConfigError("--operator-token-file must not start or end with whitespace")
        if self.operator_token and self.operator_token == self.auth_token:
            raise ConfigError(
                "the operator token must differ from the shared token (--auth-token-file)"
            )
        salts = [salt for salt, _ in self.tenant_names]
        if len(set(salts)) != len(salts):
            raise ConfigError("--tenants: two tenants or namespaces have the same cache_salt")
        if any(not salt or not name for salt, name in self.tenant_names):
            raise ConfigError("--tenants: every cache_salt and tenant name must be non-empty")
        if self.auth_token and (self.auth_token != self.auth_token.strip()):
            raise ConfigError("--auth-token must not start or end with whitespace")

        if not self.eviction_check_interval >= 0:
            raise ConfigError(
                f"--eviction-check-interval-s must be >= 0 s (0: no loop),"
                f" got {self.eviction_check_interval}"
            )
        if not 0.0 <= self.eviction_ratio <= 1.0:
            raise ConfigError(f"--eviction-ratio must be in [0, 1], got {self.eviction_ratio}")
        if not 0.0 < self.trigger_watermark <= 1.0:
            raise ConfigError(
                f"--trigger-watermark must be in (0, 1], got {self.trigger_watermark}"
            )

    def bounds(self) -> Bounds:
        """What every request about an instance is held to (`core.credentials`)."""
        return Bounds(
            max_seq_jump=self.max_seq_jump,
            max_incarnation_ahead_s=self.max_incarnation_ahead_s,
            require_credentials=self.require_instance_credentials,
        )
