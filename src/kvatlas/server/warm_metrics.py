"""Prometheus metrics of the L1 warm restart (``server.storage.l1_journal``).

Owns the tables of what this start found in its kept region (`WARM_START_STATS`) and of
the journal's health (`JOURNAL_STATS`), prefix ``kvatlas_server_l1_warm_``, each metric
written once in its row (``server.stat_table``; ``/status`` shows none), read at scrape
time; the composition root registers the collector. Must not count anything itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.server.stat_table import COUNTER, GAUGE, Stat, Table
from kvatlas.server.storage.l1_journal import L1Journal, WarmStart

_W = Stat[WarmStart]
_J = Stat[L1Journal | None]

WARM_START_STATS: Final = Table[WarmStart](
    (
        _W(
            None,
            "kvatlas_server_l1_warm_start",
            GAUGE,
            "1 for how this process started its L1: warm (chunks kept) or cold",
            lambda w: {"warm" if w.warm else "cold": 1},
            label="outcome",
        ),
        _W(
            None,
            "kvatlas_server_l1_warm_chunks",
            GAUGE,
            "Chunks a warm start kept",
            lambda w: w.chunks,
        ),
        _W(
            None,
            "kvatlas_server_l1_warm_bytes",
            GAUGE,
            "Bytes of the chunks a warm start kept",
            lambda w: w.bytes,
        ),
        _W(
            None,
            "kvatlas_server_l1_warm_corrupt_chunks",
            GAUGE,
            "Sealed chunks a warm start dropped because their bytes did not match",
            lambda w: w.corrupt,
        ),
        _W(
            None,
            "kvatlas_server_l1_warm_unsealed_writes",
            GAUGE,
            "Writes a warm start found unsealed: dropped, their range held for one lease",
            lambda w: w.unsealed,
        ),
        _W(
            None,
            "kvatlas_server_l1_warm_verify_seconds",
            GAUGE,
            "Seconds a warm start spent checking bytes",
            lambda w: w.verify_s,
        ),
    )
)

JOURNAL_STATS: Final = Table[L1Journal | None](
    (
        _J(
            None,
            "kvatlas_server_l1_warm_journal_compactions",
            COUNTER,
            "Rewrites of the L1 journal from the pool",
            lambda j: max(0, j.compactions) if j is not None else 0,
        ),
        _J(
            None,
            "kvatlas_server_l1_warm_journal_broken",
            GAUGE,
            "1 when the L1 journal could not be written (the next start is cold)",
            lambda j: 1 if j is not None and j.broken else 0,
        ),
    )
)
"""None: no journal (a server whose region is not kept)."""


class WarmStartCollector(Collector):
    def __init__(
        self, instance_id: str, found: WarmStart, journal: Callable[[], L1Journal | None]
    ) -> None:
        self._iid = instance_id
        self._found = found
        self._journal = journal

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield from WARM_START_STATS.families(self._iid, self._found)
        yield from JOURNAL_STATS.families(self._iid, self._journal())
