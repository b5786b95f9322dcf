"""Prometheus metrics of the server's cache control (``server.cache_control``).

Owns the metric names of deletes, clears and warm prefetches (prefix
``kvatlas_server_cache_``), read from ``CacheControl.stats()`` at scrape time; the
composition root registers the collector on the server's registry. Must not count
anything itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.server.cache_control import CacheControlStats
from kvatlas.server.metrics import instance_counter, instance_gauge


class CacheControlCollector(Collector):
    def __init__(self, instance_id: str, stats: Callable[[], CacheControlStats]) -> None:
        self._iid = instance_id
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats()
        iid = self._iid
        yield instance_counter(
            iid, "cache_delete_requests", "DELETE /cache/objects requests served", s.delete_requests
        )
        deleted = CounterMetricFamily(
            "kvatlas_server_cache_deleted_keys",
            "Keys removed by cache-control deletes and clears, by tier",
            labels=["instance_id", "tier"],
        )
        deleted.add_metric([iid, "l1"], s.deleted_l1)
        deleted.add_metric([iid, "l2"], s.deleted_l2)
        yield deleted
        yield instance_counter(
            iid,
            "cache_delete_skipped_locked",
            "L1 keys a non-forced delete kept because a reader or writer held them",
            s.skipped_locked,
        )
        yield instance_counter(
            iid,
            "cache_delete_l2_errors",
            "Deletes whose L2 part failed (answered ok: false)",
            s.l2_delete_errors,
        )
        yield instance_counter(iid, "cache_clears", "POST /cache/clear served", s.clears)
        prefetches = CounterMetricFamily(
            "kvatlas_server_cache_prefetches",
            "Warm prefetches by outcome (submitted, noop, refused_busy, completed, failed,"
            " expired)",
            labels=["instance_id", "outcome"],
        )
        for outcome, n in sorted(s.prefetches.items()):
            prefetches.add_metric([iid, outcome], n)
        yield prefetches
        keys = CounterMetricFamily(
            "kvatlas_server_cache_prefetch_keys",
            "Keys of finished warm prefetches by where they were found (l1, l2, peer, missing)",
            labels=["instance_id", "source"],
        )
        for source, n in sorted(s.prefetch_keys.items()):
            keys.add_metric([iid, source], n)
        yield keys
        yield instance_gauge(
            iid,
            "cache_prefetch_jobs",
            "Warm prefetch jobs in the table (running, or done and not yet polled)",
            s.jobs,
        )
