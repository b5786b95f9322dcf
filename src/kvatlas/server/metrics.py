"""Prometheus metrics of the cache server, read from stats snapshots at scrape time.

Owns a per-process CollectorRegistry and the collector that, when scraped, asks the parts
for ``stats()`` (so the hot paths count nothing extra) and renders each through its stats
table (``stat_rows``, ``p2p.stat_rows``, ``storage.stat_rows``: a metric's name, kind and
help are written in its row, beside its ``/status`` field); here only what no table holds:
the engine request counts and ``wire_unknown``, one family over two stats types. Must
not: be imported for side effects or touch the global registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.runtime.coordinator_client import ClientStats
from kvatlas.server.engine_api import EngineApiStats
from kvatlas.server.engine_service import LookupCounts
from kvatlas.server.p2p.node import P2PStats
from kvatlas.server.p2p.stat_rows import P2P_STATS, P2P_SUMMARY
from kvatlas.server.publisher import PublisherStats
from kvatlas.server.registrar import RegistrarStats
from kvatlas.server.stat_rows import (
    CLIENT_STATS,
    ENGINE_API_STATS,
    EVENT_STATS,
    LOOKUP_STATS,
    REGISTRAR_STATS,
)
from kvatlas.server.storage.chunkstore import ChunkStoreStats
from kvatlas.server.storage.stat_rows import L1_STATS, L2_STATS, LEASE_STATS, SALT_STATS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def instance_gauge(iid: str, name: str, doc: str, value: float) -> GaugeMetricFamily:
    """``kvatlas_server_<name>``: one value of the server ``iid``."""
    g = GaugeMetricFamily(f"kvatlas_server_{name}", doc, labels=["instance_id"])
    g.add_metric([iid], value)
    return g


def instance_counter(iid: str, name: str, doc: str, value: float) -> CounterMetricFamily:
    """``kvatlas_server_<name>``: one count of the server ``iid``."""
    c = CounterMetricFamily(f"kvatlas_server_{name}", doc, labels=["instance_id"])
    c.add_metric([iid], value)
    return c


class ServerMetrics(Collector):
    """A fresh registry with the server's collector: this object, which reads the parts'
    stats when scraped."""

    def __init__(
        self,
        instance_id: str,
        store: Callable[[], ChunkStoreStats],
        publisher: Callable[[], PublisherStats | None],
        registrar: Callable[[], RegistrarStats | None],
        requests: Callable[[], tuple[int, int]],
        *,
        lookups: Callable[[], LookupCounts],
        p2p: Callable[[], P2PStats | None] = lambda: None,
        coordinator: Callable[[], ClientStats | None] = lambda: None,
        engine_api: Callable[[], EngineApiStats | None] = lambda: None,
        extra: Sequence[Collector] = (),
    ) -> None:
        """``extra``: the collectors of parts that own their metric names (LMCache MP)."""
        self._iid = instance_id
        self._engine_api = engine_api
        self._coordinator = coordinator
        self._lookups = lookups
        self._p2p = p2p
        self._store = store
        self._publisher = publisher
        self._registrar = registrar
        self._requests = requests
        self.registry = CollectorRegistry(auto_describe=False)
        for collector in extra:
            self.registry.register(collector)
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        iid = self._iid
        s = self._store()
        yield from L1_STATS.families(iid, s.l1)
        yield from LEASE_STATS.families(iid, s.l1)
        yield from SALT_STATS.families(iid, s.l1_by_salt)
        yield from L2_STATS.families(iid, s)
        req, err = self._requests()
        yield instance_counter(iid, "engine_requests", "Engine API requests served.", req)
        yield instance_counter(
            iid, "engine_request_errors", "Engine API requests answered with an error.", err
        )
        ea = self._engine_api()
        if ea is not None:
            yield from ENGINE_API_STATS.families(iid, ea)
        pp = self._p2p()
        yield self._wire_unknown(ea, pp)
        yield from LOOKUP_STATS.families(iid, self._lookups())
        pub = self._publisher()
        if pub is not None:
            yield from EVENT_STATS.families(iid, pub)
        reg = self._registrar()
        if reg is not None:
            yield from REGISTRAR_STATS.families(iid, reg)
        co = self._coordinator()
        if co is not None:
            yield from CLIENT_STATS.families(iid, co)
        if pp is not None:
            yield from P2P_SUMMARY.families(iid, pp)
            yield from P2P_STATS.families(iid, pp)

    def _wire_unknown(self, ea: EngineApiStats | None, pp: P2PStats | None) -> CounterMetricFamily:
        """Requests of a newer peer or engine this server could not read, by wire."""
        c = CounterMetricFamily(
            "kvatlas_server_wire_unknown",
            "Requests answered without being read, by wire (engine, p2p) and what"
            " (version: one this server does not answer in; operation: one it does not"
            " know), each answered at once with an error.",
            labels=["instance_id", "wire", "what"],
        )
        for wire, counts in (
            ("engine", ea.unknown if ea is not None else ()),
            ("p2p", pp.wire_unknown if pp is not None else ()),
        ):
            for what, n in counts:
                c.add_metric([self._iid, wire, what], n)
        return c
