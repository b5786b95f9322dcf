"""The router's configuration: frozen data, validated once at startup.

Owns the shape, defaults and validation of ``kvatlas router``'s settings; read from flags
and environment in exactly one place (``kvatlas.cli.router``); each field is a flag, its
docstring the flag's help (``kvatlas.runtime.flag_spec``). Must not: read flags, the
environment or files itself. Validation messages name the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvatlas.core.errors import ConfigError
from kvatlas.core.keys import DEFAULT_CHUNK_SIZE
from kvatlas.router.policy import POLICIES, Policy, Weights
from kvatlas.runtime.flag_spec import cli_flag, section


@dataclass(frozen=True, slots=True)
class StaticEngine:
    """An engine given with ``--engine URL=CACHE_INSTANCE_ID``."""

    url: str
    instance_id: str


def _parse_engines(specs: list[str]) -> tuple[StaticEngine, ...]:
    return tuple(parse_engine(s) for s in specs)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything ``kvatlas router`` needs to start."""

    host: str = "127.0.0.1"
    """Interface of the router's HTTP server (``--host``)."""
    port: int = 8080
    """Port of the router's HTTP server (``--port``)."""
    coordinator_urls: tuple[str, ...] = field(
        default=(), metadata=cli_flag("--coordinator-url", custom=True)
    )
    """The coordinator's replicas, in order of preference (``--coordinator-url``, repeated
    or comma-separated): discovery and prefix lookups; empty: only ``--engine`` engines,
    routed by load."""
    engines: tuple[StaticEngine, ...] = field(
        default=(),
        metadata=cli_flag("--engine", parse=_parse_engines, metavar="URL=CACHE_INSTANCE_ID"),
    )
    """Engines given on the command line: an engine's OpenAI URL and the cache instance (as
    the coordinator knows it) that holds its KV (``--engine URL=CACHE_INSTANCE_ID``), one
    flag per engine."""
    policy: Policy = "kv-p2p"
    """How an engine is chosen (``--policy``)."""
    weights: Weights = field(default_factory=Weights, metadata=section("weight-"))
    """The cost model's weights (``--weight-*``)."""
    model_name: str = ""
    """The model name the fleet hashes under (``--model-name``); empty: what the cache
    servers declare in their registration (``models``)."""
    auth_token: str | None = field(
        default=None, repr=False, metadata=cli_flag("--auth-token", custom=True)
    )
    """The fleet's shared token (``--auth-token-file``, ...): sent to the coordinator, and
    required of the router's clients on every path but ``/healthz`` and ``/readyz``, in
    ``Authorization`` or ``Proxy-Authorization`` (``auth.RouterGate``)."""
    operator_token: str = field(
        default="", repr=False, metadata=cli_flag("--operator-token-file", custom=True)
    )
    """The operator's token (``--operator-token-file`` or ``KVATLAS_OPERATOR_TOKEN``; empty:
    none): it admits to every path, and only a request bearing it is told how it was
    routed (``X-Kvatlas-Route``: cached tokens, tier, reason), unless
    ``expose_route_header``."""
    tenants_file: str = field(default="", metadata=cli_flag("--tenants", metavar="FILE"))
    """The tenants file (``--tenants``; empty: no tenants): API keys -> tenants, the fleet
    secret salts are derived under, the client-salt policy and the shared namespaces
    (``kvatlas.core.tenancy``). With it, the OpenAI paths admit a tenant's key (401 for
    an unknown one), the request's ``cache_salt`` is the tenant's, and the other paths
    need the fleet's or the operator's token. Reloaded when the file changes."""
    expose_route_header: bool = False
    """Send ``X-Kvatlas-Route`` to every client (``--expose-route-header``): for a fleet
    with one trusted user, or debugging. It tells a client whether its prompt is cached,
    where and how much: never on for a fleet whose clients are not one party."""
    refresh_interval_s: float = field(
        default=2.0, metadata=cli_flag(deprecated=("--refresh-interval",))
    )
    """Seconds between listings of the coordinator's instances (``--refresh-interval-s``)."""
    health_interval_s: float = field(
        default=1.0, metadata=cli_flag(deprecated=("--health-interval",))
    )
    """Seconds between probes of each engine's ``/metrics`` (``--health-interval-s``)."""
    probe_timeout_s: float = field(default=2.0, metadata=cli_flag(deprecated=("--probe-timeout",)))
    """Seconds a probe waits for an engine's ``/metrics`` (``--probe-timeout-s``). An engine
    that does not answer in time (frozen, or its process stopped) is out: the requests
    none of whose answer went to the client yet are retried on their next choice, and
    its streams end with an error, at most ``health_interval_s + probe_timeout_s`` after
    it stopped answering. A busy engine must answer its probes well within it."""
    lookup_timeout_s: float = field(
        default=0.25, metadata=cli_flag(deprecated=("--lookup-timeout",))
    )
    """Deadline of the per-request tokenize and lookup (``--lookup-timeout-s``); past it
    the request is routed by load."""
    coordinator_backoff_s: float = field(
        default=2.0, metadata=cli_flag(deprecated=("--coordinator-backoff",))
    )
    """After a failed lookup, seconds the router routes by load without asking the
    coordinator (``--coordinator-backoff-s``)."""
    connect_timeout_s: float = field(
        default=1.0,
        metadata=cli_flag("--engine-connect-timeout-s", deprecated=("--engine-connect-timeout",)),
    )
    """Seconds to connect to an engine (``--engine-connect-timeout-s``)."""
    first_byte_timeout_s: float = field(
        default=600.0, metadata=cli_flag("--engine-timeout-s", deprecated=("--engine-timeout",))
    )
    """Seconds to wait for an engine's answer, and between two pieces of a stream
    (``--engine-timeout-s``)."""
    first_byte_floor_s: float = field(
        default=30.0,
        metadata=cli_flag(
            "--first-byte-deadline-floor-s", deprecated=("--first-byte-deadline-floor",)
        ),
    )
    """The least an engine's first-byte deadline can be (``--first-byte-deadline-floor-s``):
    while requests wait on an engine that has shown no sign of progress (a byte of an
    answer, a token counter of its metrics that moved) for longer than its deadline, it
    is out, even if its probe answers (its work is stuck): the requests none of whose
    answer went to the client yet go to their next choice, its streams end with an
    error. The deadline is ``first_byte_factor`` times its recent longest wait for a
    first byte, at least this, at most ``--engine-timeout-s`` (``router.firstbyte``)."""
    first_byte_factor: float = field(default=4.0, metadata=cli_flag("--first-byte-deadline-factor"))
    """Times an engine's recent longest wait for a first byte that its first-byte
    deadline allows (``--first-byte-deadline-factor``)."""
    max_held_answer_bytes: int = field(default=4 << 20, metadata=cli_flag("--max-held-answer-mb"))
    """The most of a non-streamed answer the router holds before it answers the client
    (``--max-held-answer-mb``, in MiB). An answer up to this size goes to the client
    only once it is whole, so one its engine cuts short is retried on the next choice;
    a bigger one is relayed as it comes past this size, and one cut short after that
    reaches the client cut (the connection closes before its promised length)."""
    max_attempts: int = 3
    """Engines tried per request before answering 502 (``--max-attempts``)."""
    breaker_failures: int = 3
    """Consecutive failures that open an engine's breaker (``--breaker-failures``)."""
    breaker_open_s: float = field(default=5.0, metadata=cli_flag(deprecated=("--breaker-open",)))
    """Seconds an open breaker keeps an engine out before a probe may close it
    (``--breaker-open-s``)."""
    seed: int | None = None
    """Seed of the ``random`` policy and of tie-breaking (``--seed``)."""
    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Tokens per chunk, the fleet's (``--chunk-size``): the prefixes in flight."""
    pending_ttl_s: float = field(default=60.0, metadata=cli_flag(deprecated=("--pending-ttl",)))
    """Seconds a prefix just sent to an engine counts as that engine's before the
    coordinator reports it (``--pending-ttl-s``)."""
    tokenizer_verify_every: int = 64
    """With a fast encoder (``--tokenizer``), one prompt in this many is encoded again
    by the tokenizer's own encoder on a thread of its own, after the request was routed,
    and a mismatch switches the fast encoder off (``--tokenizer-verify-every``; 0: never).
    One check at a time: a prompt whose turn comes while one runs is not checked."""

    def validate(self) -> None:
        """Raise ConfigError naming the flag of the first bad setting."""
        if not self.host:
            raise ConfigError("--host must not be empty")
        if not 0 <= self.tokenizer_verify_every <= 1_000_000:
            raise ConfigError(
                "--tokenizer-verify-every must be in [0, 1000000], got"
                f" {self.tokenizer_verify_every}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be a TCP port in [0, 65535], got {self.port}")
        if self.operator_token and self.operator_token == self.auth_token:
            raise ConfigError(
                "--operator-token-file must hold another token than the fleet's --auth-token"
            )
        if not self.coordinator_urls and not self.engines:
            raise ConfigError("give --coordinator-url, --engine URL=CACHE_INSTANCE_ID, or both")
        for url in self.coordinator_urls:
            _check_url(url, "--coordinator-url")
        bases = [u.rstrip("/") for u in self.coordinator_urls]
        doubles = sorted({u for u in bases if bases.count(u) > 1})
        if doubles:
            raise ConfigError(f"--coordinator-url names {', '.join(doubles)} more than once")
        for e in self.engines:
            _check_url(e.url, "--engine")
            if not e.instance_id:
                raise ConfigError(f"--engine {e.url}: the cache instance id must not be empty")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {list(POLICIES)}, got {self.policy!r}")
        w = self.weights
        for flag, value in (
            ("--weight-p2p", w.p2p),
            ("--weight-load", w.load),
            ("--weight-decode", w.decode),
            ("--weight-tie", w.tie),
        ):
            if not value >= 0:
                raise ConfigError(f"{flag} must not be negative, got {value}")
        for flag, secs in (
            ("--refresh-interval-s", self.refresh_interval_s),
            ("--health-interval-s", self.health_interval_s),
            ("--probe-timeout-s", self.probe_timeout_s),
            ("--lookup-timeout-s", self.lookup_timeout_s),
            ("--coordinator-backoff-s", self.coordinator_backoff_s),
            ("--engine-connect-timeout-s", self.connect_timeout_s),
            ("--engine-timeout-s", self.first_byte_timeout_s),
            ("--breaker-open-s", self.breaker_open_s),
            ("--pending-ttl-s", self.pending_ttl_s),
            ("--first-byte-deadline-floor-s", self.first_byte_floor_s),
        ):
            if not secs > 0:
                raise ConfigError(f"{flag} must be positive, got {secs}")
        if not self.first_byte_factor >= 1:
            raise ConfigError(
                f"--first-byte-deadline-factor must be at least 1, got {self.first_byte_factor}"
            )
        if self.chunk_size < 1:
            raise ConfigError(f"--chunk-size must be positive, got {self.chunk_size}")
        if self.max_held_answer_bytes < 1:
            raise ConfigError(
                "--max-held-answer-mb must be a positive size in MiB, got"
                f" {self.max_held_answer_bytes / 2**20:g}"
            )
        if self.max_attempts < 1:
            raise ConfigError(f"--max-attempts must be at least 1, got {self.max_attempts}")
        if self.breaker_failures < 1:
            raise ConfigError(f"--breaker-failures must be at least 1, got {self.breaker_failures}")


def parse_engine(spec: str) -> StaticEngine:
    """``URL=CACHE_INSTANCE_ID`` -> StaticEngine; ConfigError naming ``--engine``."""
    url, sep, instance = spec.rpartition("=")
    if not sep or not url or not instance:
        raise ConfigError(f"--engine takes URL=CACHE_INSTANCE_ID, got {spec!r}")
    _check_url(url, "--engine")
    return StaticEngine(url.rstrip("/"), instance)


def _check_url(url: str, flag: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{flag} needs an http(s) URL with a host, got {url!r}")
