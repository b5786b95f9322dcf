"""The server's cache-control stats (``server.cache_control``), each written once: its
``cache_control`` field of ``/status`` and its ``kvatlas_server_cache_*`` metric
(``server.stat_table`` generates both), and their collector.

Owns the table of deletes, clears and warm prefetches, read from ``CacheControl.stats()``
at scrape time; the composition root registers the collector on the server's registry.
Must not count anything itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.server.cache_control import CacheControlStats
from kvatlas.server.stat_table import COUNTER, GAUGE, Stat, Table

_CC = Stat[CacheControlStats]

CACHE_CONTROL_STATS: Final = Table[CacheControlStats](
    (
        _CC(
            "prefetch_jobs",
            "kvatlas_server_cache_prefetch_jobs",
            GAUGE,
            "Warm prefetch jobs in the table (running, or done and not yet polled)",
            lambda s: s.jobs,
        ),
        _CC(
            "prefetches",
            "kvatlas_server_cache_prefetches",
            COUNTER,
            "Warm prefetches by outcome (submitted, noop, refused_busy, completed, failed,"
            " expired)",
            lambda s: s.prefetches,
            label="outcome",
        ),
        _CC(
            "prefetch_keys",
            "kvatlas_server_cache_prefetch_keys",
            COUNTER,
            "Keys of finished warm prefetches by where they were found (l1, l2, peer, missing)",
            lambda s: s.prefetch_keys,
            label="source",
        ),
        _CC(
            "delete_requests",
            "kvatlas_server_cache_delete_requests",
            COUNTER,
            "DELETE /cache/objects requests served",
            lambda s: s.delete_requests,
        ),
        _CC("deleted_l1", None, COUNTER, "L1 keys deleted", lambda s: s.deleted_l1),
        _CC("deleted_l2", None, COUNTER, "L2 keys deleted", lambda s: s.deleted_l2),
        _CC(
            None,
            "kvatlas_server_cache_deleted_keys",
            COUNTER,
            "Keys removed by cache-control deletes and clears, by tier",
            lambda s: {"l1": s.deleted_l1, "l2": s.deleted_l2},
            label="tier",
        ),
        _CC(
            "skipped_locked",
            "kvatlas_server_cache_delete_skipped_locked",
            COUNTER,
            "L1 keys a non-forced delete kept because a reader or writer held them",
            lambda s: s.skipped_locked,
        ),
        _CC(
            None,
            "kvatlas_server_cache_delete_l2_errors",
            COUNTER,
            "Deletes whose L2 part failed (answered ok: false)",
            lambda s: s.l2_delete_errors,
        ),
        _CC(
            None,
            "kvatlas_server_cache_clears",
            COUNTER,
            "POST /cache/clear served",
            lambda s: s.clears,
        ),
    )
)


class CacheControlCollector(Collector):
    def __init__(self, instance_id: str, stats: Callable[[], CacheControlStats]) -> None:
        self._iid = instance_id
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield from CACHE_CONTROL_STATS.families(self._iid, self._stats())
