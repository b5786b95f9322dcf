"""The P2P stats of a cache server, each written once: its ``/status`` field and its
``kvatlas_server_p2p_*`` metric (``server.stat_table`` generates both).

`P2P_SUMMARY`: the LMCache-named ``p2p_*`` fields at the top of ``/status``;
`P2P_STATS`: kvatlas' ``p2p`` object (a ``wire.server_status.P2PStatus``), with each
peer's answer times (`PEER_TIMINGS`). Counted where they happen (``p2p.node``,
``p2p.controller``, ``p2p.fetch``), snapshotted as a ``P2PStats``.

Must not: count, or format a stat anywhere but in its row.
"""

from __future__ import annotations

from typing import Any, Final

from kvatlas.core.server.peer_timing import PeerTimingView
from kvatlas.server.p2p.node import P2PStats
from kvatlas.server.stat_table import COUNTER, GAUGE, Each, Field, Items, Stat, Table, ms
from kvatlas.wire.server_status import PeerTimingStatus

_P = Stat[P2PStats]
_T = Stat[PeerTimingView]

PEER_TIMINGS: Final = Each(
    Table[PeerTimingView](
        (
            Field("peer", lambda t: t.peer),
            _T(
                "rpc_samples",
                None,
                GAUGE,
                "Control round trips (lock and unlock RPCs) kept for the p99.",
                lambda t: t.rpc_samples,
            ),
            _T(
                "rpc_p99_ms",
                "kvatlas_server_p2p_peer_rpc_p99_seconds",
                GAUGE,
                "The p99 of the peer's control round trips (lock and unlock RPCs).",
                lambda t: t.rpc_p99_s,
                shown=ms,
            ),
            _T(
                "bandwidth_mib_s",
                "kvatlas_server_p2p_peer_bandwidth_bytes_per_second",
                GAUGE,
                "The EWMA of the peer's load bandwidth.",
                lambda t: t.bandwidth_bps,
                shown=lambda bps: round(bps / 2**20, 3),
            ),
            _T(
                "lock_deadline_ms",
                "kvatlas_server_p2p_lock_deadline_seconds",
                GAUGE,
                "What a lookup_and_lock to the peer waits now (its RPC p99 x a factor, at"
                " least the floor; the prior before it answered), before a lookup's"
                " recompute cap.",
                lambda t: t.lock_deadline_s,
                shown=ms,
            ),
            _T(
                "last_lock_deadline_ms",
                None,
                GAUGE,
                "The lock deadline the peer's last lookup_and_lock got (recompute cap applied).",
                lambda t: t.last_lock_deadline_s,
                shown=ms,
            ),
            _T(
                "last_load_deadline_ms",
                "kvatlas_server_p2p_load_deadline_seconds",
                GAUGE,
                "The deadline the peer's last load got (bytes / its bandwidth x a factor,"
                " capped by recompute and --p2p-load-timeout-s).",
                lambda t: t.last_load_deadline_s,
                shown=ms,
            ),
        )
    ),
    PeerTimingStatus,
    "peer",
    lambda t: t.peer,
)

P2P_SUMMARY: Final = Table[P2PStats](
    (
        Field("p2p_state", lambda p: p.state.value),
        _P(
            "p2p_peer_count",
            "kvatlas_server_p2p_peers",
            GAUGE,
            "Peers with a P2P adapter.",
            lambda p: len(p.peers),
        ),
        Field("p2p_peers", lambda p: list(p.peers)),
        _P(
            "active_p2p_lookup_jobs",
            "kvatlas_server_active_p2p_lookup_jobs",
            GAUGE,
            "P2P fetches in progress.",
            lambda p: p.active_lookup_jobs,
        ),
    )
)


def p2p_off() -> dict[str, Any]:
    """`P2P_SUMMARY`'s fields of a server with P2P off."""
    return {
        "p2p_state": "unregistered",
        "p2p_peer_count": 0,
        "p2p_peers": [],
        "active_p2p_lookup_jobs": 0,
    }


P2P_STATS: Final = Table[P2PStats](
    (
        Field("transfer_engine", lambda p: p.transport),
        Field("advertise_url", lambda p: p.advertise_url),
        Field("transfer_url", lambda p: p.transfer_url),
        _P(
            "lookups",
            "kvatlas_server_p2p_lookups",
            COUNTER,
            "Local misses that asked peers.",
            lambda p: p.fetch.lookups,
        ),
        _P(
            "chunks_fetched",
            "kvatlas_server_p2p_chunks_fetched",
            COUNTER,
            "Chunks read from peers into L1.",
            lambda p: p.fetch.chunks_fetched,
        ),
        _P(
            "bytes_read",
            "kvatlas_server_p2p_bytes_read",
            COUNTER,
            "Bytes read from peers.",
            lambda p: p.fetch.bytes_read,
        ),
        _P(
            "lock_requests",
            None,
            COUNTER,
            "lookup_and_lock RPCs sent to peers.",
            lambda p: p.fetch.locks_requested,
        ),
        _P(
            "directory_lookups",
            None,
            COUNTER,
            "Directory lookups for a local miss's holders.",
            lambda p: p.fetch.directory_lookups,
        ),
        _P(
            "directory_failures",
            "kvatlas_server_p2p_directory_failures",
            COUNTER,
            "Directory lookups that failed.",
            lambda p: p.fetch.directory_failures,
        ),
        _P(
            "all_peer_fallbacks",
            "kvatlas_server_p2p_blind_lookups",
            COUNTER,
            "Lookups that asked a few peers blindly: the directory could not be asked.",
            lambda p: p.fetch.all_peer_fallbacks,
        ),
        _P(
            "fallbacks",
            "kvatlas_server_p2p_fallbacks",
            COUNTER,
            "P2P failures that became a recompute, by cause.",
            lambda p: {cause.value: n for cause, n in p.fetch.fallbacks.items()},
            label="cause",
        ),
        Field("cooling_peers", lambda p: list(p.cooling_peers)),
        _P(
            None,
            "kvatlas_server_p2p_peers_down",
            GAUGE,
            "Peers whose breaker is open.",
            lambda p: len(p.cooling_peers),
        ),
        _P(
            "served_locks",
            None,
            COUNTER,
            "lookup_and_lock requests of peers answered.",
            lambda p: p.served_locks,
        ),
        _P(
            "served_chunks",
            "kvatlas_server_p2p_served_chunks",
            COUNTER,
            "Chunks locked for peers.",
            lambda p: p.served_chunks,
        ),
        _P(
            "served_unlocks",
            None,
            COUNTER,
            "unlock requests of peers answered.",
            lambda p: p.served_unlocks,
        ),
        _P(
            "served_reads",
            None,
            COUNTER,
            "Reads of this node's L1 that peers were allowed (one per transfer op).",
            lambda p: p.served_reads,
        ),
        _P(
            "refused_requests",
            None,
            COUNTER,
            "Control requests of peers refused (bad token or invalid input).",
            lambda p: p.refused_requests,
        ),
        _P(
            "adapters_added",
            None,
            COUNTER,
            "Peer adapters added.",
            lambda p: p.adapters_added,
        ),
        _P(
            "adapters_removed",
            None,
            COUNTER,
            "Peer adapters removed.",
            lambda p: p.adapters_removed,
        ),
        _P(
            "adapters_rebuilt",
            None,
            COUNTER,
            "Peer adapters rebuilt (a new incarnation or endpoint).",
            lambda p: p.adapters_rebuilt,
        ),
        _P(
            "polls",
            None,
            COUNTER,
            "Peer listings asked of the coordinator.",
            lambda p: p.polls,
        ),
        _P(
            "poll_failures",
            None,
            COUNTER,
            "Peer listings that failed (the peers were kept).",
            lambda p: p.poll_failures,
        ),
        _P(
            "no_holder",
            "kvatlas_server_p2p_no_holder",
            COUNTER,
            "Local misses the directory named no holder for.",
            lambda p: p.fetch.no_holder,
        ),
        _P(
            "breakers_opened",
            "kvatlas_server_p2p_breakers_opened",
            COUNTER,
            "Times a peer's breaker opened.",
            lambda p: p.breakers_opened,
        ),
        _P(
            "probes",
            None,
            COUNTER,
            "Half-open probes sent to peers whose breaker is open.",
            lambda p: p.probes,
        ),
        _P(
            "lock_deadline_prior_ms",
            None,
            GAUGE,
            "A lookup_and_lock's deadline before any peer answered one.",
            lambda p: p.lock_deadline_prior_s,
            shown=lambda s: s * 1000,
        ),
        _P(
            "fleet_rpc_p99_ms",
            None,
            GAUGE,
            "The p99 of all peers' control round trips: the prior of a peer not yet heard.",
            lambda p: p.fleet_rpc_p99_s,
            shown=ms,
        ),
        Items("peer_timings", lambda p: p.timings, PEER_TIMINGS),
        _P(
            "promoting_locks",
            "kvatlas_server_p2p_promoting_locks",
            COUNTER,
            "Lock RPCs to a peer holding some of the keys in L2 only (they wait the lookup's"
            " remaining time, not the peer's learned lock deadline).",
            lambda p: p.fetch.promoting_locks,
        ),
    )
)
