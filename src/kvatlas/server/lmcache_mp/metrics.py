"""Prometheus metrics of the LMCache MP protocol (prefix ``kvatlas_server_lmcache_``).

Read at scrape time from the handler's and the service's counters. Must not: count
anything itself or touch the global registry.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.server.lmcache_mp.transport import LMCacheMPHandler
from kvatlas.server.metrics import instance_counter, instance_gauge


class LMCacheMPCollector(Collector):
    def __init__(self, instance_id: str, handler: LMCacheMPHandler) -> None:
        self._iid = instance_id
        self._handler = handler

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        svc = self._handler.service
        requests = CounterMetricFamily(
            "kvatlas_server_lmcache_requests",
            "LMCache MP requests decoded and dispatched, by operation.",
            labels=["instance_id", "operation"],
        )
        for op, n in sorted(svc.counts.items()):
            requests.add_metric([self._iid, op], n)
        yield requests
        errors = CounterMetricFamily(
            "kvatlas_server_lmcache_errors",
            "LMCache MP requests answered with an error reply (or frames dropped), by reason:"
            " malformed, version (another LMCache release), unsupported (an operation"
            " kvatlas does not serve), not_registered, invalid, contract, internal,"
            " stream_control, no_space, pickle_refused, server_module (a plug-in method:"
            " answered with LMCache's unknown-method reply).",
            labels=["instance_id", "reason"],
        )
        for reason, n in sorted((self._handler.errors + svc.refused).items()):
            errors.add_metric([self._iid, reason], n)
        yield errors
        yield instance_gauge(
            self._iid,
            "lmcache_sessions",
            "LMCache request sessions open (a lookup not yet ended).",
            len(svc.sessions),
        )
        yield instance_counter(
            self._iid,
            "lmcache_sessions_dropped",
            "LMCache sessions dropped, oldest first, beyond the session limit (their read"
            " leases were released: a client that never sends end_session).",
            svc.sessions.dropped,
        )
        yield instance_gauge(
            self._iid,
            "lmcache_unhashed_chunks",
            "Chunks LMCache workers stored whose checksum the quiet-time hasher has yet to"
            " compute (a peer's lock request hashes up to 64 MiB of them itself).",
            svc.unhashed_chunks,
        )
        workers = GaugeMetricFamily(
            "kvatlas_server_lmcache_workers",
            "LMCache workers with a registered KV cache, by transfer mode.",
            labels=["instance_id", "mode"],
        )
        for mode, n in svc.worker_modes().items():
            workers.add_metric([self._iid, mode], n)
        yield workers
