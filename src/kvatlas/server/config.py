"""The cache server's configuration: frozen dataclasses, validated once at startup.

Owns the defaults and the consistency rules between settings. Each field is a flag, its
docstring the flag's help (``kvatlas.runtime.flag_spec``); it is filled from flags and
environment in exactly one place (``kvatlas.cli.server``); ``validate()`` raises
ConfigError with a message that names the flags an operator has to change. Must not:
read the environment, parse arguments or open anything.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from kvatlas.core.errors import ConfigError
from kvatlas.core.keys import DEFAULT_CHUNK_SIZE
from kvatlas.core.server.eviction import POLICIES
from kvatlas.core.server.l1pool import MIN_ALIGN_BYTES
from kvatlas.core.server.peer_timing import DeadlinePolicy
from kvatlas.core.types import InstanceId
from kvatlas.core.vllm_hash import DEFAULT_SEED, HASH_ALGOS
from kvatlas.runtime.flag_spec import cli_flag, from_env, section
from kvatlas.server.lmcache_mp.wire import LMCACHE_VERSION
from kvatlas.transfer.config import MooncakeConfig
from kvatlas.transfer.factory import TRANSPORTS
from kvatlas.wire.events_api import EventFormat
from kvatlas.wire.kafka_records import DEFAULT_PARTITIONER, DEFAULT_TOPIC

GIB: Final = 1 << 30
MAX_PORT: Final = 65535

EventTransport = Literal["http", "kafka"]


def default_state_dir() -> Path:
    """``~/.cache/kvatlas`` when the home directory is writable, else ``<tmp>/kvatlas``."""
    home = Path.home()
    if home.is_dir() and os.access(home, os.W_OK):
        return home / ".cache" / "kvatlas"
    return Path(tempfile.gettempdir()) / "kvatlas"


@dataclass(frozen=True, slots=True)
class L1Config:
    """The shared-memory L1 tier."""

    size_bytes: int = field(default=1 * GIB, metadata=cli_flag("--l1-size-gb"))
    """Size of the L1 region, in GiB on the flag (``--l1-size-gb``, fractions allowed)."""
    eviction_policy: str = field(default="LRU", metadata=cli_flag("--eviction-policy"))
    """Which READY chunks to evict first (``--eviction-policy``)."""
    align_bytes: int = MIN_ALIGN_BYTES
    """Every slot starts at a multiple of this (``--l1-align-bytes``; a power of two
    >= 4096; 65536 recommended with P2P)."""
    prefault: bool = True
    """Touch every page of the region at startup (``--no-l1-prefault`` skips it): the
    memory is then really reserved and no store or peer read pays first-touch faults."""
    warm_restart: bool = True
    """Keep the region in ``/dev/shm`` past the process (``--l1-warm-restart``, default
    on): a start with the same instance id and state dir serves the chunks it finds
    there again, each checked against its checksum (``server.storage.l1_journal``).
    Off: a fresh region per start, removed when the server exits."""
    tenant_min_share: float = field(default=0.0, metadata=cli_flag(metavar="FRACTION"))
    """Fraction of L1 each active cache_salt (tenant) is guaranteed against other
    tenants' stores (``--l1-tenant-min-share``, in [0, 1]), cut down to the equal split
    when more tenants are active than the fractions fit: ``min(FRACTION * capacity,
    capacity // active salts)``. A tenant over its share evicts its own least recently
    used chunks first, then those of tenants over theirs; one at or below it loses
    chunks only to its own stores (``core.l1shares``). 0, the default: one global LRU."""


@dataclass(frozen=True, slots=True)
class L2Config:
    """The local disk tier; absent when ``path`` is None."""

    path: Path | None = None
    """Directory of the L2 files (``--l2-path``); None disables L2."""
    size_bytes: int = field(default=0, metadata=cli_flag("--l2-size-gb"))
    """Budget of L2, in GiB on the flag (``--l2-size-gb``, needs ``--l2-path``); 0 with a
    path means 10 GiB."""


def _strip_urls(values: list[str]) -> tuple[str, ...]:
    """``--engine-url`` values without a trailing slash."""
    return tuple(u.rstrip("/") for u in values)


@dataclass(frozen=True, slots=True)
class CoordinatorLink:
    """How this server reaches the coordinator (where it registers and sends events);
    no ``urls`` means it works alone. Not the coordinator's own config
    (``kvatlas.coordinator.config.CoordinatorConfig``)."""

    urls: tuple[str, ...] = field(default=(), metadata=cli_flag("--coordinator-url", custom=True))
    """Base URLs of the coordinator's replicas, in order of preference (``--coordinator-url``,
    repeated or comma-separated); empty: no registration, no events."""
    advertise_ip: str = "127.0.0.1"
    """IP the coordinator and peers use to reach this server (``--coordinator-advertise-ip``)."""
    heartbeat_interval_s: float = field(
        default=5.0, metadata=cli_flag(compat=("--coordinator-heartbeat-interval",))
    )
    """Seconds between heartbeats (``--coordinator-heartbeat-interval-s``)."""
    request_timeout_s: float = field(
        default=5.0,
        metadata=cli_flag("--coordinator-timeout-s", deprecated=("--coordinator-timeout",)),
    )
    """Seconds one request may wait on one coordinator replica before the next is asked
    (``--coordinator-timeout-s``)."""
    auth_token: str | None = field(
        default=None, repr=False, metadata=cli_flag("--auth-token", custom=True)
    )
    """Sent as ``Authorization: Bearer`` (``--auth-token`` / ``KVATLAS_AUTH_TOKEN``)."""
    engine_urls: tuple[str, ...] = field(
        default=(), metadata=cli_flag("--engine-url", parse=_strip_urls, metavar="URL")
    )
    """OpenAI URLs of this node's engines, advertised in the registration for routers
    (``--engine-url``, repeatable); engines that register may add their own."""
    engine_kv_events: tuple[str, ...] = field(
        default=(),
        metadata=cli_flag(
            "--engine-kv-events", metavar="[ENGINE=]tcp://HOST:PORT[,replay=tcp://HOST:PORT,...]"
        ),
    )
    """KV event sources of this node's vLLM engines (``--engine-kv-events``: options as
    the coordinator's ``--vllm-kv-events``, ENGINE defaulting to ``--instance-id``),
    advertised in the registration for a coordinator started with
    ``--vllm-kv-events-from-members`` to subscribe to."""


@dataclass(frozen=True, slots=True)
class KafkaConfig:
    """The Kafka event sink (``--event-transport kafka``)."""

    bootstrap_servers: str = ""
    """``host:port[,host:port]`` of the brokers (``--kafka-bootstrap-servers``)."""
    topic: str = DEFAULT_TOPIC
    """Topic the batches go to, keyed by instance id (``--kafka-topic``)."""
    partitioner: str = DEFAULT_PARTITIONER
    """librdkafka partitioner of the batches (``--kafka-partitioner``); it must be the
    coordinators' ``--kafka-partitioner``, so that an instance's events and membership
    records share a partition."""


@dataclass(frozen=True, slots=True)
class EventConfig:
    """How cache events are batched, buffered and sent."""

    transport: EventTransport = "http"
    """``http`` (POST /events of the coordinator) or ``kafka`` (``--event-transport``)."""
    http_format: EventFormat = field(default="msgpack", metadata=cli_flag("--event-format"))
    """Body of POST /events: compact msgpack or LMCache-compatible JSON (``--event-format``)."""
    flush_interval_s: float = field(
        default=1.0, metadata=cli_flag(deprecated=("--event-flush-interval",))
    )
    """Seconds between flushes; each flush cuts batches and sends
    (``--event-flush-interval-s``)."""
    buffer_batches: int = 4096
    """Unsent batches kept for retry; beyond it the oldest are dropped and counted
    (``--event-buffer-batches``)."""
    max_batch_entries: int = 512
    """Entries per batch at most (``--event-max-batch-entries``)."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig, metadata=section("kafka-"))


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """This server's L1/L2 as vLLM KV events (``--kv-events-*``; off by default)."""

    endpoint: str | None = field(default=None, metadata=cli_flag(metavar="tcp://HOST:PORT"))
    """ZeroMQ PUB socket it binds (``--kv-events-endpoint``, e.g.
    ``tcp://10.0.0.5:5557``, an IPv6 address in brackets; ``tcp://*:5557``, vLLM's
    default, binds every interface)."""
    replay_endpoint: str | None = field(default=None, metadata=cli_flag(metavar="tcp://HOST:PORT"))
    """ROUTER socket it binds for replays (``--kv-events-replay-endpoint``)."""
    topic: str = ""
    """Topic of every message (``--kv-events-topic``; vLLM's default is empty)."""
    buffer_steps: int = 10_000
    """Batches kept for replay (``--kv-events-buffer-steps``, as vLLM's)."""
    max_queue: int = 10_000
    """Store changes queued for the publisher's thread before more are dropped and
    counted (``--kv-events-max-queue``): the store never waits on it. Prompts shown to
    the publisher have a queue of the same size."""
    block_size: int = 16
    """The engines' KV block size (``--kv-events-block-size``, vLLM's ``--block-size``):
    each chunk is published as ``chunk_size / block_size`` blocks of this many tokens,
    as readers that rehash token ids (NVIDIA Dynamo, llm-d) need. Must divide
    ``--chunk-size``."""
    hash_algo: str = field(default="sha256", metadata=cli_flag(metavar="|".join(HASH_ALGOS)))
    """How those blocks are hashed (``--kv-events-hash-algo``): the engines'
    ``--prefix-caching-hash-algo``, vLLM 0.34's default ``sha256``; one of
    ``core.vllm_hash.HASH_ALGOS``."""
    hash_seed: str = DEFAULT_SEED
    """The seed of the first block's parent (``--kv-events-hash-seed``): the engines'
    ``PYTHONHASHSEED`` when set, else vLLM's ``vllm-none-hash`` (the ``xxhash``
    algorithms take a random one per engine unless ``PYTHONHASHSEED`` is set)."""
    prompt_tokens: int = 8_000_000
    """Tokens of recent prompts kept until their chunks are stored
    (``--kv-events-prompt-tokens``; 4 bytes each): the store never holds a chunk's
    tokens, and a chunk whose tokens are unknown is not published."""

    def problems(self, chunk_size: int) -> list[str]:
        """What is wrong, each naming its flag; ``chunk_size`` the server's
        ``--chunk-size``, which ``block_size`` must divide."""
        out: list[str] = []
        for flag, ep in (
            ("--kv-events-endpoint", self.endpoint),
            ("--kv-events-replay-endpoint", self.replay_endpoint),
        ):
            if ep is not None and (
                not ep.startswith("tcp://") or split_host_port(ep[len("tcp://") :]) is None
            ):
                out.append(f"{flag} must be tcp://HOST:PORT, got {ep!r}")
        if self.replay_endpoint and not self.endpoint:
            out.append("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.endpoint and self.endpoint == self.replay_endpoint:
            out.append("--kv-events-endpoint and --kv-events-replay-endpoint must differ")
        if self.buffer_steps < 1:
            out.append(f"--kv-events-buffer-steps must be >= 1, got {self.buffer_steps}")
        if self.max_queue < 1:
            out.append(f"--kv-events-max-queue must be >= 1, got {self.max_queue}")
        if self.block_size < 1:
            out.append(f"--kv-events-block-size must be >= 1, got {self.block_size}")
        elif self.endpoint and chunk_size > 0 and chunk_size % self.block_size:
            out.append(
                f"--kv-events-block-size {self.block_size} must divide --chunk-size"
                f" {chunk_size}: a chunk is published as whole engine blocks"
            )
        if self.hash_algo not in HASH_ALGOS:
            out.append(
                f"--kv-events-hash-algo must be one of {', '.join(HASH_ALGOS)},"
                f" got {self.hash_algo!r}"
            )
        if self.prompt_tokens < 0:
            out.append(f"--kv-events-prompt-tokens must be >= 0, got {self.prompt_tokens}")
        return out


@dataclass(frozen=True, slots=True)
class P2PConfig:
    """Peer-to-peer KV sharing; enabled by ``advertise_url``."""

    advertise_url: str | None = None
    """``HOST:PORT`` of this server's P2P control channel as peers reach it
    (``--p2p-advertise-url``); setting it enables P2P. The transport's own address is
    not derived from it: peers read it from the endpoint in the registration."""
    listen_url: str | None = None
    """``HOST:PORT`` the control channel binds (``--p2p-listen-url``); defaults to the
    advertise URL (bind 0.0.0.0 while advertising a routable address)."""
    lookup_timeout_s: float = field(
        default=30.0, metadata=cli_flag(compat=("--p2p-lookup-timeout",))
    )
    """Longest a lookup waits for peers' ``lookup_and_lock`` answers
    (``--p2p-lookup-timeout-s``); each lock RPC has its own, much shorter, learned deadline
    (``core.peer_timing``: the ``lock_deadline_*`` settings)."""
    load_timeout_s: float = field(default=30.0, metadata=cli_flag(compat=("--p2p-load-timeout",)))
    """Longest wait for a load from a peer (``--p2p-load-timeout-s``); a peer whose
    bandwidth is known gets ``load_deadline_factor`` x bytes / bandwidth."""
    lock_deadline_floor_s: float = field(
        default=0.025, metadata=cli_flag(deprecated=("--p2p-lock-deadline-floor",))
    )
    """The least a lock RPC to a peer waits (``--p2p-lock-deadline-floor-s``)."""
    lock_deadline_factor: float = 4.0
    """A lock RPC waits this many times the peer's observed RPC p99, at least the floor
    (``--p2p-lock-deadline-factor``)."""
    lock_deadline_prior_s: float = field(
        default=0.1, metadata=cli_flag(deprecated=("--p2p-lock-deadline-prior",))
    )
    """A lock RPC's deadline before any peer answered one (``--p2p-lock-deadline-prior-s``;
    why 0.1 s: ``core.peer_timing.DeadlinePolicy.lock_prior_s``)."""
    load_deadline_factor: float = 4.0
    """A load waits this many times its bytes / the peer's observed bandwidth
    (``--p2p-load-deadline-factor``), capped by recompute and the load timeout."""
    transport: str = field(default="tcp", metadata=cli_flag("--p2p-transfer-engine"))
    """The transport that moves KV bytes: tcp, shm, mooncake or nixl
    (``--p2p-transfer-engine``)."""
    data_port: int = 0
    """Port the tcp transport's data channel binds on the listen host
    (``--p2p-data-port``); 0: a free port the OS picks. The bound port is announced in
    the endpoint this server registers, so peers never guess it."""
    mooncake: MooncakeConfig = field(
        default_factory=MooncakeConfig,
        metadata=from_env("MC_TE_PROTOCOL", "MC_TE_DEVICE", "MC_TRANSFER_TIMEOUT"),
    )
    """Mooncake's settings from ``MC_TE_PROTOCOL``, ``MC_TE_DEVICE`` and
    ``MC_TRANSFER_TIMEOUT`` (read by the CLI); only the mooncake transport uses them, and
    its host is the advertise URL's."""
    recompute_s_per_token: float = field(
        default=0.0, metadata=cli_flag("--p2p-expected-recompute-s-per-token")
    )
    """Expected recompute seconds per missing token when an engine sends no estimate
    (``--p2p-expected-recompute-s-per-token``); 0: ``default_recompute_s_per_token``."""
    default_recompute_s_per_token: float = 0.005
    """The recompute cost per missing token assumed when neither the engine nor
    ``recompute_s_per_token`` gives one (``--p2p-default-recompute-s-per-token``): 5 ms,
    a slow prefill (200 tokens/s), so that P2P is rarely cut short, yet a lookup of a few
    chunks never waits the timeouts' 30 s on a peer that does not answer."""
    directory_timeout_s: float = field(
        default=0.075, metadata=cli_flag(deprecated=("--p2p-directory-timeout",))
    )
    """Longest wait for the directory's answer to a local miss
    (``--p2p-directory-timeout-s``). The directory answers in a few milliseconds; past
    this the lookup treats it as unreachable (a few peers asked briefly), and later
    lookups do not ask it again until the controller's next peer listing succeeds, so a
    frozen coordinator costs no local miss more than this once."""
    lock_lease_s: float = field(
        default=30.0, metadata=cli_flag(deprecated=("--p2p-lock-lease-seconds",))
    )
    """Lease a peer's ``lookup_and_lock`` holds on our chunks if it never unlocks
    (``--p2p-lock-lease-s``)."""
    cooloff_s: float = field(default=10.0, metadata=cli_flag(deprecated=("--p2p-cooloff-seconds",)))
    """Seconds a peer whose breaker opened is skipped before it is probed again, the most
    between probes (``--p2p-cooloff-s``); a new incarnation or a probe it answers
    closes the breaker sooner."""
    fault_corrupt_read: int | None = None
    """TESTS ONLY: flip a byte of the Nth chunk this server reads from peers, as it lands
    (``--p2p-fault-corrupt-read``; the transfer client's fault plan)."""
    fault_read_delay_s: float = field(
        default=0.0, metadata=cli_flag(deprecated=("--p2p-fault-read-delay",))
    )
    """TESTS ONLY: delay every read this server serves (``--p2p-fault-read-delay-s``)."""

    @property
    def enabled(self) -> bool:
        return bool(self.advertise_url)

    @property
    def bind_url(self) -> str:
        return self.listen_url or self.advertise_url or ""

    @property
    def deadline_policy(self) -> DeadlinePolicy:
        return DeadlinePolicy(
            lock_floor_s=self.lock_deadline_floor_s,
            lock_p99_factor=self.lock_deadline_factor,
            lock_prior_s=self.lock_deadline_prior_s,
            load_factor=self.load_deadline_factor,
        )


def split_host_port(url: str) -> tuple[str, int] | None:
    """``HOST:PORT`` -> (host, port); None when it is not of that form."""
    host, sep, port = url.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < MAX_PORT:
        return None
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything ``kvatlas server`` needs; build it in ``kvatlas.cli.server`` only."""

    instance_id: InstanceId
    """This server's name in the fleet (``--instance-id``), unique per server; default:
    ``HOSTNAME-PORT``."""
    host: str = "127.0.0.1"
    """Interface the engine API and HTTP endpoints bind (``--host``)."""
    port: int = 6555
    """ZeroMQ port of the kvatlas engine API and LMCache's MP protocol (``--port``)."""
    http_port: int = 7555
    """HTTP port of /status, /metrics, /healthz (``--http-port``)."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Tokens per chunk; engines must register the same (``--chunk-size``)."""
    state_dir: Path = field(default_factory=default_state_dir)
    """Where the incarnation counter lives (``--state-dir``); default: ``~/.cache/kvatlas``
    when the home directory is writable, else ``<tmp>/kvatlas``."""
    lease_s: float = field(default=30.0, metadata=cli_flag(deprecated=("--lease-seconds",)))
    """Default read and write lease seconds handed to engines (``--lease-s``)."""
    engine_workers: int = 4
    """Threads serving engine requests behind the ROUTER socket (``--engine-workers``)."""
    engine_p2p_workers: int = 4
    """More threads for lookups that wait on peers, and the most such lookups at once
    (``--engine-p2p-workers``); a lookup finding them all busy answers its local prefix."""
    engine_max_queued: int = 1024
    """Engine requests held at once (queued or being served) before more are answered
    ``overloaded`` at once (``--engine-max-queued``): bounds the memory a flood takes."""
    engine_max_queued_per_client: int = 64
    """The same bound per engine socket (``--engine-max-queued-per-client``), so that one
    flooding engine cannot fill the queue for all."""
    lmcache_mp: str = field(
        default="auto",
        metadata=cli_flag(
            help=f"LMCache MP protocol on --port, releases {LMCACHE_VERSION} (each request's"
            " own, on one port): on, off, or auto (on unless --auth-token is set: LMCache"
            " clients send no token; on admits them anyway)"
        ),
    )
    """LMCache's MP protocol on ``--port`` (``--lmcache-mp``): ``on``; ``off``; ``auto``
    (the default): on unless ``--auth-token`` is set, since LMCache's protocol carries
    no token. ``on`` with a token admits LMCache clients unauthenticated (loopback or a
    trusted network only)."""
    lmcache_transfer_mode: str = field(
        default="auto", metadata=cli_flag("--supported-transfer-mode")
    )
    """The LMCache transfer modes served (``--supported-transfer-mode``, LMCache's flag):
    ``lmcache_driven``, ``engine_driven`` or ``auto`` (both, the default here; LMCache's
    own default is ``lmcache_driven``)."""
    l1: L1Config = field(default_factory=L1Config, metadata=section("l1-", "L1 (shared memory)"))
    l2: L2Config = field(default_factory=L2Config, metadata=section("l2-", "L2 (local disk)"))
    coordinator: CoordinatorLink = field(
        default_factory=CoordinatorLink, metadata=section("coordinator-", "the coordinator")
    )
    events: EventConfig = field(
        default_factory=EventConfig, metadata=section("event-", "cache events to the coordinator")
    )
    p2p: P2PConfig = field(
        default_factory=P2PConfig,
        metadata=section("p2p-", "P2P KV sharing (needs --coordinator-url)"),
    )
    kv_events: KvEventsConfig = field(
        default_factory=KvEventsConfig,
        metadata=section("kv-events-", "vLLM KV events of this server's L1/L2 (default off)"),
    )

    def validate(self) -> None:
        """Raise ConfigError naming the flags of the first inconsistency found."""
        problems = list(_problems(self))
        if problems:
            raise ConfigError("invalid server configuration: " + "; ".join(problems))


def _problems(c: ServerConfig) -> list[str]:
    out: list[str] = []
    if not c.instance_id:
        out.append("--instance-id must not be empty")
    for flag, port in (("--port", c.port), ("--http-port", c.http_port)):
        if not 0 <= port <= MAX_PORT:
            out.append(f"{flag} must be in [0, {MAX_PORT}], got {port}")
    if c.port == c.http_port and c.port != 0:
        out.append(f"--port and --http-port must differ, both are {c.port}")
    if c.chunk_size <= 0:
        out.append(f"--chunk-size must be positive, got {c.chunk_size}")
    if not c.lease_s > 0:
        out.append(f"--lease-s must be positive, got {c.lease_s}")
    if c.lmcache_mp not in ("auto", "on", "off"):
        out.append(f"--lmcache-mp must be auto, on or off, got {c.lmcache_mp!r}")
    if c.lmcache_transfer_mode not in ("auto", "lmcache_driven", "engine_driven"):
        out.append(
            "--supported-transfer-mode must be lmcache_driven, engine_driven or auto, got"
            f" {c.lmcache_transfer_mode!r}"
        )
    if c.engine_workers < 1:
        out.append(f"--engine-workers must be >= 1, got {c.engine_workers}")
    if c.engine_p2p_workers < 1:
        out.append(f"--engine-p2p-workers must be >= 1, got {c.engine_p2p_workers}")
    if c.engine_max_queued < 1:
        out.append(f"--engine-max-queued must be >= 1, got {c.engine_max_queued}")
    if not 1 <= c.engine_max_queued_per_client <= c.engine_max_queued:
        out.append(
            "--engine-max-queued-per-client must be in [1, --engine-max-queued"
            f" {c.engine_max_queued}], got {c.engine_max_queued_per_client}"
        )
    a = c.l1.align_bytes
    if a < MIN_ALIGN_BYTES or a & (a - 1):
        out.append(f"--l1-align-bytes must be a power of two >= {MIN_ALIGN_BYTES}, got {a}")
    elif c.l1.size_bytes < a:
        out.append(
            f"--l1-size-gb must hold at least one aligned slot of {a} bytes"
            f" (--l1-align-bytes), got {c.l1.size_bytes} bytes"
        )
    if not 0.0 <= c.l1.tenant_min_share <= 1.0:
        out.append(
            "--l1-tenant-min-share must be a fraction in [0, 1] (0: off),"
            f" got {c.l1.tenant_min_share}"
        )
    if c.l1.eviction_policy.upper() not in POLICIES:
        out.append(
            f"--eviction-policy {c.l1.eviction_policy!r} is unknown;"
            f" accepted: {', '.join(sorted(POLICIES))}"
        )
    if c.l2.path is None and c.l2.size_bytes:
        out.append("--l2-size-gb needs --l2-path (where the L2 files live)")
    if c.l2.size_bytes < 0:
        out.append(f"--l2-size-gb must be >= 0, got {c.l2.size_bytes} bytes")
    co = c.coordinator
    if co.urls and not co.advertise_ip.strip():  # the coordinator refuses an empty ip
        out.append("--coordinator-advertise-ip must not be empty when --coordinator-url is set")
    for url in co.urls:
        if not url.startswith(("http://", "https://")):
            out.append(f"--coordinator-url must start with http:// or https://, got {url!r}")
    bases = [u.rstrip("/") for u in co.urls]
    doubles = sorted({u for u in bases if bases.count(u) > 1})
    if doubles:
        out.append(f"--coordinator-url names {', '.join(doubles)} more than once")
    if not co.heartbeat_interval_s > 0:
        out.append(
            f"--coordinator-heartbeat-interval-s must be positive, got {co.heartbeat_interval_s}"
        )
    if not co.request_timeout_s > 0:
        out.append(f"--coordinator-timeout-s must be positive, got {co.request_timeout_s}")
    for url in co.engine_urls:
        if not url.startswith(("http://", "https://")) or "," in url:
            out.append(f"--engine-url must be an http(s) URL without commas, got {url!r}")
    for spec in co.engine_kv_events:
        if ";" in spec or "tcp://" not in spec:
            out.append(
                f"--engine-kv-events takes [ENGINE=]tcp://HOST:PORT[,replay=...] without ';',"
                f" got {spec!r}"
            )
    ev = c.events
    if ev.transport not in ("http", "kafka"):
        out.append(f"--event-transport must be http or kafka, got {ev.transport!r}")
    if ev.transport == "kafka" and not ev.kafka.bootstrap_servers:
        out.append("--event-transport kafka needs --kafka-bootstrap-servers")
    if ev.transport == "kafka" and not ev.kafka.topic:
        out.append("--kafka-topic must not be empty")
    if ev.transport == "kafka" and not ev.kafka.partitioner:
        out.append("--kafka-partitioner must not be empty")
    if ev.http_format not in ("msgpack", "json"):
        out.append(f"--event-format must be msgpack or json, got {ev.http_format!r}")
    if not ev.flush_interval_s > 0:
        out.append(f"--event-flush-interval-s must be positive, got {ev.flush_interval_s}")
    if ev.buffer_batches < 1:
        out.append(f"--event-buffer-batches must be >= 1, got {ev.buffer_batches}")
    if ev.max_batch_entries < 1:
        out.append(f"--event-max-batch-entries must be >= 1, got {ev.max_batch_entries}")
    out.extend(_p2p_problems(c))
    out.extend(c.kv_events.problems(c.chunk_size))
    return out


def _p2p_problems(c: ServerConfig) -> list[str]:
    pp = c.p2p
    out: list[str] = []
    if not pp.enabled:
        if pp.listen_url:
            out.append("--p2p-listen-url needs --p2p-advertise-url (which enables P2P)")
        if pp.data_port:
            out.append("--p2p-data-port needs --p2p-advertise-url (which enables P2P)")
        return out
    if not c.coordinator.urls:
        out.append(
            "P2P requires a coordinator for peer discovery: --p2p-advertise-url needs"
            " --coordinator-url"
        )
    for flag, url in (
        ("--p2p-advertise-url", pp.advertise_url),
        ("--p2p-listen-url", pp.listen_url),
    ):
        if url is not None and split_host_port(url) is None:
            out.append(f"{flag} must be HOST:PORT with a port in [1, {MAX_PORT - 1}], got {url!r}")
    p2p_ports: dict[int, str] = {}
    bound = split_host_port(pp.bind_url)
    if bound is not None:
        p2p_ports[bound[1]] = "the P2P control port of --p2p-listen-url or --p2p-advertise-url"
    if not 0 <= pp.data_port <= MAX_PORT:
        out.append(f"--p2p-data-port must be in [0, {MAX_PORT}], got {pp.data_port}")
    elif pp.data_port and pp.transport != "tcp":
        out.append(
            f"--p2p-data-port is the tcp transport's; --p2p-transfer-engine {pp.transport}"
            " chooses its own address"
        )
    elif pp.data_port in p2p_ports:
        out.append(
            f"--p2p-data-port {pp.data_port} is also {p2p_ports[pp.data_port]};"
            " give them different ports"
        )
    elif pp.data_port:
        p2p_ports[pp.data_port] = "--p2p-data-port, the tcp transport's data port"
    for flag, port in (("--port", c.port), ("--http-port", c.http_port)):
        if port and port in p2p_ports:
            out.append(f"{flag} {port} is also {p2p_ports[port]}; give them different ports")
    if pp.transport not in TRANSPORTS:
        out.append(
            f"--p2p-transfer-engine {pp.transport!r} is unknown; accepted: {', '.join(TRANSPORTS)}"
        )
    for flag, value in (
        ("--p2p-lookup-timeout-s", pp.lookup_timeout_s),
        ("--p2p-load-timeout-s", pp.load_timeout_s),
        ("--p2p-lock-lease-s", pp.lock_lease_s),
        ("--p2p-cooloff-s", pp.cooloff_s),
        ("--p2p-directory-timeout-s", pp.directory_timeout_s),
        ("--p2p-default-recompute-s-per-token", pp.default_recompute_s_per_token),
        ("--p2p-lock-deadline-floor-s", pp.lock_deadline_floor_s),
        ("--p2p-lock-deadline-prior-s", pp.lock_deadline_prior_s),
    ):
        if not value > 0:
            out.append(f"{flag} must be positive, got {value}")
    for flag, value in (
        ("--p2p-lock-deadline-factor", pp.lock_deadline_factor),
        ("--p2p-load-deadline-factor", pp.load_deadline_factor),
    ):
        if not value >= 1:
            out.append(f"{flag} must be >= 1 (a deadline below what the peer takes), got {value}")
    if pp.lock_deadline_prior_s > pp.lookup_timeout_s:
        out.append(
            f"--p2p-lock-deadline-prior-s ({pp.lock_deadline_prior_s}) must not exceed"
            f" --p2p-lookup-timeout-s ({pp.lookup_timeout_s})"
        )
    if pp.recompute_s_per_token < 0:
        out.append(
            f"--p2p-expected-recompute-s-per-token must be >= 0, got {pp.recompute_s_per_token}"
        )
    return out
