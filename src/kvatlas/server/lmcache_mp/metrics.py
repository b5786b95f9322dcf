"""Prometheus metrics of the LMCache MP protocol (prefix ``kvatlas_server_lmcache_``).

Owns `MpStats`, one reading of the handler's and the service's counters, and
`MP_STATS`, their table (``server.stat_table``: each metric written once, in its row;
``/status`` shows none), read at scrape time. Must not: count anything itself or touch
the global registry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.server.lmcache_mp.transport import LMCacheMPHandler
from kvatlas.server.stat_table import COUNTER, GAUGE, Stat, Table


@dataclass(frozen=True, slots=True)
class MpStats:
    """The LMCache MP counters at one scrape."""

    requests: Mapping[str, int]
    errors: Mapping[str, int]
    sessions: int
    sessions_dropped: int
    unhashed_chunks: int
    workers: Mapping[str, int]

    @classmethod
    def read(cls, handler: LMCacheMPHandler) -> MpStats:
        svc = handler.service
        return cls(
            requests=dict(svc.counts),
            errors=dict(handler.errors + svc.refused),
            sessions=len(svc.sessions),
            sessions_dropped=svc.sessions.dropped,
            unhashed_chunks=svc.unhashed_chunks,
            workers=svc.worker_modes(),
        )


_S = Stat[MpStats]

MP_STATS: Final = Table[MpStats](
    (
        _S(
            None,
            "kvatlas_server_lmcache_requests",
            COUNTER,
            "LMCache MP requests decoded and dispatched, by operation.",
            lambda s: s.requests,
            label="operation",
        ),
        _S(
            None,
            "kvatlas_server_lmcache_errors",
            COUNTER,
            "LMCache MP requests answered with an error reply (or frames dropped), by reason:"
            " malformed, version (another LMCache release), unsupported (an operation"
            " kvatlas does not serve), not_registered, invalid, contract, internal,"
            " stream_control, no_space, pickle_refused, server_module (a plug-in method:"
            " answered with LMCache's unknown-method reply).",
            lambda s: s.errors,
            label="reason",
        ),
        _S(
            None,
            "kvatlas_server_lmcache_sessions",
            GAUGE,
            "LMCache request sessions open (a lookup not yet ended).",
            lambda s: s.sessions,
        ),
        _S(
            None,
            "kvatlas_server_lmcache_sessions_dropped",
            COUNTER,
            "LMCache sessions dropped, oldest first, beyond the session limit (their read"
            " leases were released: a client that never sends end_session).",
            lambda s: s.sessions_dropped,
        ),
        _S(
            None,
            "kvatlas_server_lmcache_unhashed_chunks",
            GAUGE,
            "Chunks LMCache workers stored whose checksum the quiet-time hasher has yet to"
            " compute (a peer's lock request hashes up to 64 MiB of them itself).",
            lambda s: s.unhashed_chunks,
        ),
        _S(
            None,
            "kvatlas_server_lmcache_workers",
            GAUGE,
            "LMCache workers with a registered KV cache, by transfer mode.",
            lambda s: s.workers,
            label="mode",
        ),
    )
)


class LMCacheMPCollector(Collector):
    def __init__(self, instance_id: str, handler: LMCacheMPHandler) -> None:
        self._iid = instance_id
        self._handler = handler

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield from MP_STATS.families(self._iid, MpStats.read(self._handler))
