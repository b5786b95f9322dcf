"""The fleet page's shapes: `GET /ui/fleet.json`, and what it reads of each server.

Owns the document the coordinator's fleet page polls (`FleetDocument`: the coordinator's
counters, its directory stats, and one `MemberView` per live member with what that
member's `/status` said or why it said nothing), the page's lenient reading of a server's
`/status` (`MemberStatus`), and the registration metadata keys a server uses to tell the
coordinator where its `/status` is, how often it heartbeats, and where its engines
answer (for routers). Must not: fetch, hold
state, or know the coordinator's or the server's internals.

Why `MemberStatus` is not `server_status.ServerStatus`: that Struct is the document a
server writes, every field required, so that both sides agree on it. The coordinator
reads the servers of a whole fleet, which are upgraded after it (docs/deploy.md) or may
be another implementation: here every field the page shows has a default and unknown
fields are ignored, so a server of another version still shows what it shares with this
one instead of turning "unreadable". Its field names are ServerStatus's (a test decodes
one as the other).
"""

from __future__ import annotations

import msgspec

from kvatlas.wire.coordinator_views import StatsResponse

STATUS_URL_KEY = "status_url"
"""Registration metadata: the URL of the server's `/status` as the coordinator reaches it."""
HEARTBEAT_INTERVAL_KEY = "heartbeat_interval_s"
"""Registration metadata: seconds between the server's heartbeats."""
ENGINE_URLS_KEY = "engine_urls"
"""Registration metadata: the OpenAI URLs of the node's engines, comma-separated, for
routers (the server's ``--engine-url`` and what its engines advertise)."""


def status_url(ip: str, http_port: int) -> str:
    """`/status` on ``ip:http_port`` (an IPv6 address in brackets)."""
    host = f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip
    return f"http://{host}:{http_port}/status"


# ---- a server's /status, as the page reads it -------------------------------------------


class L1View(msgspec.Struct, frozen=True):
    capacity_bytes: int = 0
    used_bytes: int = 0
    chunks: int = 0
    evictions: int = 0
    cross_salt_evictions: int = 0
    """Of ``evictions``, those that took another cache_salt's chunk."""
    tenant_share_bytes: int = 0
    """The L1 bytes each active cache_salt is guaranteed on this server now; 0: per-tenant
    shares are off (a count, no salt: shown to every viewer)."""


class L1SaltView(msgspec.Struct, frozen=True):
    """One cache_salt's part of a server's L1 (an entry of its ``l1_by_salt``)."""

    bytes: int = 0
    chunks: int = 0
    evicted_by_own: int = 0
    evicted_by_others: int = 0


class L2View(msgspec.Struct, frozen=True):
    enabled: bool = False
    capacity_bytes: int = 0
    used_bytes: int = 0


class EventsView(msgspec.Struct, frozen=True):
    """The server's event publisher: its backlog and its failures."""

    transport: str = ""
    pending: int = 0
    buffered_batches: int = 0
    sent_events: int = 0
    failed_sends: int = 0
    dropped_events: int = 0
    last_error: str = ""


class LookupsView(msgspec.Struct, frozen=True):
    """Engine lookups since the server started (the hit rate is hit_chunks / chunks)."""

    requests: int = 0
    chunks: int = 0
    hit_chunks: int = 0
    peer_chunks: int = 0


class P2PView(msgspec.Struct, frozen=True):
    transfer_engine: str = ""
    lookups: int = 0
    chunks_fetched: int = 0
    bytes_read: int = 0
    served_chunks: int = 0
    fallbacks: dict[str, int] = {}
    """P2P misses that became a recompute, by cause (``stale_hint`` among them)."""
    cooling_peers: list[str] = []


class MemberStatus(msgspec.Struct, frozen=True):
    """What the page shows of one server's `/status`."""

    uptime_s: float = 0.0
    registration_state: str = ""
    l1: L1View = L1View()
    l2: L2View = L2View()
    events: EventsView = EventsView()
    lookups: LookupsView = LookupsView()
    p2p_enabled: bool = False
    p2p_state: str = ""
    p2p_peer_count: int = 0
    p2p_peers: list[str] = []
    active_p2p_lookup_jobs: int = 0
    p2p: P2PView | None = None
    l1_by_salt: dict[str, L1SaltView] = {}
    """Per cache_salt: read to build the per-salt rows (`SaltQuotaView`), always empty in
    the document (a member's salts are the tenants' identity, shown summed per salt to
    the operator only)."""


# ---- the document -----------------------------------------------------------------------


class MemberView(msgspec.Struct, frozen=True):
    """One live member: the coordinator's view of it, and its own `/status`."""

    instance_id: str
    incarnation: int
    address: str
    """``ip:http_port`` as the member registered it."""
    heartbeat_age_s: float
    stale_after_s: float
    """A heartbeat older than this means the member missed several (or is gone)."""
    stale: bool
    status_url: str
    status: MemberStatus | None
    """None when the member did not answer (``error`` says why)."""
    error: str = ""
    fetch_ms: float = 0.0
    p2p_advertised_url: str = ""


class CoordinatorCounters(msgspec.Struct, frozen=True):
    """The coordinator's own counters since it started (the page derives rates)."""

    batches: dict[str, float]
    """Event batches by outcome (applied, duplicate, stale, invalid)."""
    entries: dict[str, float]
    """Event entries by batch outcome."""
    lookups: dict[str, float]
    """Directory lookups by kind (keys, tokens, blend)."""
    gaps: float
    missing_seqs: float
    fences: dict[str, float]
    """L1 slices fenced, by reason."""
    expiries: float
    kafka_records: dict[str, float]
    kafka_lag: dict[str, float]
    """Records behind the high watermark, by partition (empty without Kafka)."""


class SaltQuotaView(msgspec.Struct, frozen=True):
    """One ``cache_salt``'s L2 usage against its quota, and its L1 on the servers."""

    cache_salt: str
    l2_bytes: int
    limit_bytes: int | None
    """The salt's own quota; None: it has none."""
    effective_limit_bytes: int | None
    """What the eviction loop holds it to (its quota, else the default; None: exempt)."""
    pinned_keys: int
    tenant: str = ""
    """What the salt belongs to (``tenant:ID``, ``shared:NAME``) per the coordinator's
    ``--tenants`` file; empty: no file, or a salt it does not derive."""
    l1_bytes: int = 0
    """L1 bytes under this salt, summed over the members that answered."""
    l1_chunks: int = 0
    l1_evicted_by_own: int = 0
    """Its L1 chunks evicted for its own stores, summed over members."""
    l1_evicted_by_others: int = 0
    """Its L1 chunks evicted to make room for other salts' stores, summed over members."""
    l1_shares: dict[str, int] = {}
    """Instance id -> the L1 bytes that member guarantees each active salt
    (``--l1-tenant-min-share``), for the members holding this salt with shares on."""


class QuotasView(msgspec.Struct, frozen=True):
    """Quotas, usage against them and pins (the fleet L2 eviction loop's state)."""

    default_limit_bytes: int | None
    """The quota of salts without one; None: they are exempt from eviction."""
    pinned_keys: int
    salts: list[SaltQuotaView]
    """Empty when ``salts_hidden``."""
    eviction_interval_s: float
    """Seconds between sweeps; 0: no loop."""
    l2_bytes: int = 0
    """L2 bytes of every salt together."""
    salts_over_quota: int = 0
    """Salts whose L2 bytes reach their effective limit."""
    salts_hidden: bool = False
    """True for a viewer who may not see tenants (an operator token is set and the
    request did not bear it): ``salts`` is empty, the sums above stay."""


class FleetDocument(msgspec.Struct, frozen=True):
    """`GET /ui/fleet.json`."""

    generated_at: float
    """Unix time the document was assembled."""
    cache_s: float
    """How long the coordinator serves this same document before assembling a new one."""
    event_transport: str
    ready: bool
    not_ready_reason: str
    instance_timeout_s: float
    counters: CoordinatorCounters
    directory: StatsResponse
    """What `GET /directory/stats` answers."""
    members: list[MemberView]
    quotas: QuotasView | None = None
