"""Prometheus metrics of the L1 warm restart (``server.storage.l1_journal``).

Owns the metric names of what this start found in its kept region and of the journal's
health (prefix ``kvatlas_server_l1_warm_``), read at scrape time; the composition root
registers the collector. Must not count anything itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvatlas.server.metrics import instance_counter, instance_gauge
from kvatlas.server.storage.l1_journal import L1Journal, WarmStart


class WarmStartCollector(Collector):
    def __init__(
        self, instance_id: str, found: WarmStart, journal: Callable[[], L1Journal | None]
    ) -> None:
        self._iid = instance_id
        self._found = found
        self._journal = journal

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        iid, w = self._iid, self._found
        start = GaugeMetricFamily(
            "kvatlas_server_l1_warm_start",
            "1 for how this process started its L1: warm (chunks kept) or cold",
            labels=["instance_id", "outcome"],
        )
        start.add_metric([iid, "warm" if w.warm else "cold"], 1)
        yield start
        yield instance_gauge(iid, "l1_warm_chunks", "Chunks a warm start kept", w.chunks)
        yield instance_gauge(iid, "l1_warm_bytes", "Bytes of the chunks a warm start kept", w.bytes)
        yield instance_gauge(
            iid,
            "l1_warm_corrupt_chunks",
            "Sealed chunks a warm start dropped because their bytes did not match",
            w.corrupt,
        )
        yield instance_gauge(
            iid,
            "l1_warm_unsealed_writes",
            "Writes a warm start found unsealed: dropped, their range held for one lease",
            w.unsealed,
        )
        yield instance_gauge(
            iid, "l1_warm_verify_seconds", "Seconds a warm start spent checking bytes", w.verify_s
        )
        journal = self._journal()
        yield instance_counter(
            iid,
            "l1_warm_journal_compactions",
            "Rewrites of the L1 journal from the pool",
            max(0, journal.compactions) if journal is not None else 0,
        )
        yield instance_gauge(
            iid,
            "l1_warm_journal_broken",
            "1 when the L1 journal could not be written (the next start is cold)",
            1 if journal is not None and journal.broken else 0,
        )
