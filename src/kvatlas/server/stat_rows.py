"""The cache server's own stats, each written once: its ``/status`` field and its
``kvatlas_server_*`` metric (``server.stat_table`` generates both).

`LOOKUP_STATS` (``lookups``: the engine service's ``LookupCounts``), `EVENT_STATS`
(``events``: the publisher's), `REGISTRAR_STATS` (``coordinator``), and the stats only
``/metrics`` shows: `ENGINE_API_STATS` (the engine API's queue) and `CLIENT_STATS` (the
coordinator client's replicas). The parts with tables of their own: ``p2p.stat_rows``,
``storage.stat_rows``, ``cache_metrics``.

Must not: count, or format a stat anywhere but in its row.
"""

from __future__ import annotations

from typing import Final

from kvatlas.runtime.coordinator_client import ClientStats
from kvatlas.server.engine_api import EngineApiStats
from kvatlas.server.engine_service import LookupCounts
from kvatlas.server.publisher import PublisherStats
from kvatlas.server.registrar import RegistrarStats, RegistrationState
from kvatlas.server.stat_table import COUNTER, GAUGE, Field, Stat, Table

_LK = Stat[LookupCounts]
_EV = Stat[PublisherStats]
_REG = Stat[RegistrarStats]
_ENG = Stat[EngineApiStats]
_CO = Stat[ClientStats]

LOOKUP_STATS: Final = Table[LookupCounts](
    (
        _LK("requests", "kvatlas_server_lookups", COUNTER, "Engine lookups.", lambda k: k.lookups),
        _LK(
            "chunks",
            "kvatlas_server_lookup_chunks",
            COUNTER,
            "Chunks engines looked up.",
            lambda k: k.chunks,
        ),
        _LK(
            "hit_chunks",
            "kvatlas_server_lookup_hit_chunks",
            COUNTER,
            "Looked-up chunks answered as hits.",
            lambda k: k.hit_chunks,
        ),
        _LK(
            "peer_chunks",
            "kvatlas_server_lookup_peer_chunks",
            COUNTER,
            "Hit chunks read from peers.",
            lambda k: k.peer_chunks,
        ),
        _LK(
            "recompute_s_per_token",
            "kvatlas_server_engine_recompute_seconds_per_token",
            GAUGE,
            "Prefill seconds per token the model's engines reported (or implied by their"
            " recompute estimates); it bounds the peer wait of lookups without an estimate.",
            lambda k: k.recompute_s_per_token,
            label="model",
        ),
        _LK(
            "learned_estimates",
            "kvatlas_server_lookup_learned_estimates",
            COUNTER,
            "Lookups without a recompute estimate bounded by a learned engine rate.",
            lambda k: k.learned_estimates,
        ),
        _LK(
            "flag_estimates",
            "kvatlas_server_lookup_flag_estimates",
            COUNTER,
            "Lookups without a recompute estimate and no learned rate: bounded by the"
            " --p2p-*-recompute-s-per-token flags.",
            lambda k: k.flag_estimates,
        ),
    )
)

EVENT_STATS: Final = Table[PublisherStats](
    (
        _EV(
            "pending",
            "kvatlas_server_events_pending",
            GAUGE,
            "Events not yet batched.",
            lambda p: p.pending_entries,
        ),
        _EV(
            "buffered_batches",
            "kvatlas_server_event_batches_buffered",
            GAUGE,
            "Unsent batches.",
            lambda p: p.buffered_batches,
        ),
        _EV(
            "sent_batches",
            "kvatlas_server_event_batches_sent",
            COUNTER,
            "Event batches delivered.",
            lambda p: p.sent_batches,
        ),
        _EV(
            "sent_events",
            "kvatlas_server_events_sent",
            COUNTER,
            "Cache events delivered.",
            lambda p: p.sent_entries,
        ),
        _EV(
            "retries",
            "kvatlas_server_event_batches_retried",
            COUNTER,
            "Batches sent again.",
            lambda p: p.retried_batches,
        ),
        _EV(
            "failed_sends",
            "kvatlas_server_event_send_failures",
            COUNTER,
            "Failed event sends.",
            lambda p: p.failed_sends,
        ),
        _EV(
            "dropped_batches",
            None,
            COUNTER,
            "Batches dropped: buffer full.",
            lambda p: p.dropped_batches,
        ),
        _EV(
            "dropped_events",
            "kvatlas_server_events_dropped",
            COUNTER,
            "Events dropped: buffer full.",
            lambda p: p.dropped_entries,
        ),
        _EV("last_seq", None, GAUGE, "The seq of the last batch cut.", lambda p: p.last_seq),
        Field("last_error", lambda p: p.last_error),
        _EV(
            "rejected_batches",
            "kvatlas_server_event_batches_rejected",
            COUNTER,
            "Batches sent for the first time that the coordinator answered as duplicate"
            " or stale (another sender speaks for this instance).",
            lambda p: p.rejected_batches,
        ),
    )
)
"""``events``; its ``transport`` is given by the caller (the config's)."""

REGISTRAR_STATS: Final = Table[RegistrarStats](
    (
        Field("state", lambda r: r.state.value),
        _REG(
            None,
            "kvatlas_server_registered",
            GAUGE,
            "1 when registered with the coordinator.",
            lambda r: 1 if r.state is RegistrationState.REGISTERED else 0,
        ),
        _REG("registrations", None, COUNTER, "Registrations.", lambda r: r.registrations),
        _REG("heartbeats", None, COUNTER, "Heartbeats sent.", lambda r: r.heartbeats),
        _REG(
            "heartbeat_failures",
            None,
            COUNTER,
            "Heartbeats that failed.",
            lambda r: r.heartbeat_failures,
        ),
        _REG(
            "reregistrations_after_404",
            None,
            COUNTER,
            "Registrations again after the coordinator did not know this instance.",
            lambda r: r.reregistrations_after_404,
        ),
        _REG(
            "resyncs",
            "kvatlas_server_resyncs",
            COUNTER,
            "Resyncs after the coordinator lost state.",
            lambda r: r.resyncs,
        ),
        Field("contracts", lambda r: list(r.contracts)),
        Field("last_error", lambda r: r.last_error),
        Field("url", lambda r: r.url),
        _REG(
            "failovers",
            None,
            COUNTER,
            "Times the server moved to another coordinator replica.",
            lambda r: r.failovers,
        ),
    )
)

ENGINE_API_STATS: Final = Table[EngineApiStats](
    (
        _ENG(
            None,
            "kvatlas_server_engine_requests_queued",
            GAUGE,
            "Engine requests held now (queued or served).",
            lambda e: e.queued,
        ),
        _ENG(
            None,
            "kvatlas_server_engine_clients_queued",
            GAUGE,
            "Engine sockets with requests held now.",
            lambda e: e.clients_queued,
        ),
        _ENG(
            None,
            "kvatlas_server_engine_requests_overloaded",
            COUNTER,
            "Engine requests answered 'overloaded' at once, unserved: --engine-max-queued"
            " or --engine-max-queued-per-client was full.",
            lambda e: e.overloaded,
        ),
    )
)

CLIENT_STATS: Final = Table[ClientStats](
    (
        _CO(
            None,
            "kvatlas_server_coordinator_failovers",
            COUNTER,
            "Moves to another coordinator replica.",
            lambda c: c.failovers,
        ),
        _CO(
            None,
            "kvatlas_server_coordinator_replicas_skipped",
            GAUGE,
            "Coordinator replicas skipped after failing (breaker open).",
            lambda c: sum(1 for r in c.replicas if r.skipped_for_s > 0),
        ),
        _CO(
            None,
            "kvatlas_server_coordinator_replica_failures",
            COUNTER,
            "Requests to a coordinator replica that got no answer or a 5xx.",
            lambda c: {r.url: r.failures for r in c.replicas},
            label="url",
        ),
        _CO(
            None,
            "kvatlas_server_coordinator_replica_in_use",
            GAUGE,
            "1 for the coordinator replica in use, 0 for the others.",
            lambda c: {r.url: 1 if r.url == c.url else 0 for r in c.replicas},
            label="url",
        ),
    )
)
