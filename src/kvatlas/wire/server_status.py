"""The cache server's ``GET /status`` document, as msgspec Structs.

The server builds and encodes a `ServerStatus`; the evaluation, the benches and anyone
else decode the same Struct (`decode_status`), so a field cannot be renamed on one side
only. The field names are the operators' (LMCache's ``p2p_*`` names first, then kvatlas'
counters); ``p2p`` is left out of the document when P2P is off.

Owns the shapes only: no I/O, no state, no mapping from the server's stats (that is
``server.status``'s).
"""

from __future__ import annotations

import msgspec


class RegistrarStatus(msgspec.Struct, frozen=True):
    """``coordinator``: the registrar's standing with the coordinator."""

    state: str
    """registered, disconnected or unregistered."""
    registrations: int
    heartbeats: int
    heartbeat_failures: int
    reregistrations_after_404: int
    resyncs: int
    contracts: list[str]
    """Models whose hash contract this server declared."""
    last_error: str
    url: str = ""
    """The coordinator replica in use (of those ``--coordinator-url`` names)."""
    failovers: int = 0
    """Times the server moved to another coordinator replica."""


class L1Status(msgspec.Struct, frozen=True):
    region_name: str
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    chunks: int
    writing: int
    evictions: int
    largest_free_bytes: int
    cross_salt_evictions: int = 0
    """Of ``evictions``, those that took another cache_salt's chunk than the allocating
    request's."""
    tenant_share_bytes: int = 0
    """The L1 bytes each active cache_salt is guaranteed now (``--l1-tenant-min-share``,
    cut down to the equal split); 0: per-tenant shares are off."""


class L1SaltStatus(msgspec.Struct, frozen=True):
    """One cache_salt's part of L1 (an entry of ``l1_by_salt``)."""

    bytes: int
    """Reserved L1 bytes: committed chunks and writes in progress."""
    chunks: int
    """Committed chunks."""
    evicted_by_own: int
    """Its chunks evicted to make room for its own requests."""
    evicted_by_others: int
    """Its chunks evicted to make room for other cache_salts' requests."""


class L2Status(msgspec.Struct, frozen=True):
    enabled: bool
    capacity_bytes: int
    used_bytes: int
    promotions: int
    promotion_failures: int
    demotions: int
    demotion_failures: int


class LeaseStatus(msgspec.Struct, frozen=True):
    read: int
    write: int


class EventStatus(msgspec.Struct, frozen=True):
    """The event publisher (zeros, transport ``none``, without a coordinator)."""

    transport: str
    pending: int
    buffered_batches: int
    sent_batches: int
    sent_events: int
    retries: int
    failed_sends: int
    dropped_batches: int
    dropped_events: int
    last_seq: int
    last_error: str
    rejected_batches: int = 0
    """Batches sent for the first time that the coordinator answered as duplicate or
    stale: another sender spoke for this instance."""


class LookupStatus(msgspec.Struct, frozen=True):
    """``lookups``: engine lookups since the server started (the hit rate is
    ``hit_chunks / chunks``)."""

    requests: int
    chunks: int
    """Full chunks the engines asked about."""
    hit_chunks: int
    """Of those, the leading chunks answered as a hit (local or read from peers)."""
    peer_chunks: int
    """Of the hits, chunks read from peers for the lookup."""
    recompute_s_per_token: dict[str, float] = {}
    """Per model, the prefill seconds per token its engines reported (or implied by
    their recompute estimates): a lookup that carries no estimate is bounded by it."""
    learned_estimates: int = 0
    """Lookups without an estimate whose peer wait was bounded by a learned rate."""
    flag_estimates: int = 0
    """Lookups without an estimate and no learned rate: the ``--p2p-*-recompute-*``
    flags bounded their peer wait."""


class PeerTimingStatus(msgspec.Struct, frozen=True):
    """What a server learned of one peer's answer times, and the deadlines they give."""

    peer: str
    rpc_samples: int
    """Control round trips (lock and unlock RPCs) kept for the p99."""
    rpc_p99_ms: float | None
    bandwidth_mib_s: float | None
    """The EWMA of its loads' bandwidth (None: not known, a load waits the recompute cap)."""
    lock_deadline_ms: float
    """What a lookup_and_lock to it waits now (before a lookup's recompute cap)."""
    last_lock_deadline_ms: float | None
    """The lock deadline its last lookup_and_lock got (recompute cap applied)."""
    last_load_deadline_ms: float | None
    """The deadline its last load got (bytes / bandwidth x factor, capped)."""


class P2PStatus(msgspec.Struct, frozen=True):
    """kvatlas' P2P counters: the requester's reads and fallbacks, the owner's service."""

    transfer_engine: str
    advertise_url: str
    transfer_url: str
    lookups: int
    chunks_fetched: int
    bytes_read: int
    lock_requests: int
    directory_lookups: int
    directory_failures: int
    all_peer_fallbacks: int
    fallbacks: dict[str, int]
    """Fallbacks to recompute by cause."""
    cooling_peers: list[str]
    served_locks: int
    served_chunks: int
    served_unlocks: int
    served_reads: int
    """Reads of this node's L1 that peers were allowed (one per transfer op)."""
    refused_requests: int
    adapters_added: int
    adapters_removed: int
    adapters_rebuilt: int
    polls: int
    """Peer listings asked of the coordinator."""
    poll_failures: int
    """Peer listings that failed (the peers were kept)."""
    no_holder: int
    """Local misses the directory named no holder for: no peer was asked."""
    breakers_opened: int
    """Times a peer's breaker opened (it is skipped while in ``cooling_peers``)."""
    probes: int
    """Half-open probes sent to peers whose breaker is open."""
    lock_deadline_prior_ms: float = 0.0
    """A lookup_and_lock's deadline before any peer answered one."""
    fleet_rpc_p99_ms: float | None = None
    """The p99 of all peers' control round trips: the prior of a peer not yet heard."""
    peer_timings: list[PeerTimingStatus] = []
    promoting_locks: int = 0
    """Lock RPCs to a peer holding some of the keys in L2 only (they wait the lookup's
    remaining time: the peer reads its disk first)."""


class CacheControlStatus(msgspec.Struct, frozen=True):
    """``cache_control``: what coordinators asked of this server through ``/cache/*``."""

    prefetch_jobs: int
    """Warm prefetch jobs running, or done and not yet polled."""
    prefetches: dict[str, int]
    """By outcome: submitted, noop, refused_busy, completed, failed, expired."""
    prefetch_keys: dict[str, int]
    """Keys of finished prefetches by where they were found: l1, l2, peer, missing."""
    delete_requests: int
    deleted_l1: int
    deleted_l2: int
    skipped_locked: int
    """L1 keys a delete kept because a reader or writer held them (not forced)."""


class ServerStatus(msgspec.Struct, frozen=True, omit_defaults=True):
    """``GET /status`` of a cache server."""

    instance_id: str
    incarnation: int
    uptime_s: float
    engine_port: int
    http_port: int
    chunk_size: int
    registration_state: str
    """registered, disconnected or unregistered (also without a coordinator)."""
    coordinator: RegistrarStatus | None
    """None when the server runs without a coordinator."""
    l1: L1Status
    l2: L2Status
    leases: LeaseStatus
    events: EventStatus
    models: list[str]
    engines: int
    lookups: LookupStatus
    p2p_enabled: bool
    p2p_state: str
    """registered, disconnected or unregistered: this server in the peer listing."""
    p2p_peer_count: int
    p2p_peers: list[str]
    """Instance ids of the peers with an adapter, sorted."""
    active_p2p_lookup_jobs: int
    p2p: P2PStatus | None = None
    """Absent from the document when P2P is off."""
    cache_control: CacheControlStatus | None = None
    """Absent from a document of a server that has no cache control (older ones)."""
    l1_by_salt: dict[str, L1SaltStatus] = {}
    """Per cache_salt ("" is the unsalted namespace): what it holds in L1 and what was
    evicted of it; salts emptied lately stay with zero bytes (a bounded number). Absent
    while no salt ever held L1."""


_decoder = msgspec.json.Decoder(ServerStatus)


def decode_status(body: bytes) -> ServerStatus:
    """A ``/status`` body; msgspec.DecodeError or ValidationError when it is not one."""
    return _decoder.decode(body)
