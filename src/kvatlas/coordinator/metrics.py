"""Prometheus metrics of the coordinator, in a per-app registry (never the global one).

Owns the counters and histograms the shells bump at the edges (ingest outcomes, fences,
lookups, Kafka records), a collector that reads a state sample at scrape time
(directory sizes, live instances, heartbeat ages, gaps), one that reads the HTTP edge's
sample (connections, buffered body bytes, refusals by cause), one that reads the garbage
collector's pauses (`runtime.gc_pauses`), and the counters' totals as one
Struct for the fleet page (`counters()`); a second registry holds the families labelled by
``cache_salt``, rendered only for callers who may see tenants. Must not hold state of its own
beyond the counters, nor take the fleet lock itself: the sample function does that.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvatlas.coordinator.http.edge.server import EdgeStats
from kvatlas.core.keys import DEFAULT_CHAIN_NAME
from kvatlas.core.types import InstanceId
from kvatlas.runtime.gc_pauses import GcPauses
from kvatlas.wire.fleet_view import CoordinatorCounters
from kvatlas.wire.json_tokens import DEFAULT_PARSER_NAME

_LOOKUP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class StateSample(msgspec.Struct, frozen=True):
    """What the scrape-time collector reads from the service (under its lock)."""

    keys: int
    placements_by_tier: dict[str, int]
    bytes_by_tier: dict[str, int]
    live_instances: int
    provisional_instances: int
    heartbeat_age: dict[InstanceId, float]
    gaps: dict[InstanceId, int]
    missing: dict[InstanceId, int]
    blend_chunks: int
    token_bytes: int = 0
    declared_capacity: list[tuple[str, str, str, int]] = []
    """(instance, tier, backend, bytes) of every declared compartment."""
    departed_instances: int = 0
    """Instances gone whose L2 placements wait out the retention."""
    dropped: dict[InstanceId, int] = {}
    """Events each instance reported dropping (its cursor's ``dropped``)."""
    chunk_size: int = 0
    chunk_size_bound: bool = False


class _StateCollector(Collector):
    def __init__(self, sample: Callable[[], StateSample]) -> None:
        self._sample = sample

    def collect(self) -> Iterable[Metric]:
        s = self._sample()
        keys = GaugeMetricFamily(
            "kvatlas_coordinator_directory_keys", "Keys in the directory", value=s.keys
        )
        placements = GaugeMetricFamily(
            "kvatlas_coordinator_directory_placements", "Placements by tier", labels=["tier"]
        )
        for tier, n in sorted(s.placements_by_tier.items()):
            placements.add_metric([tier], n)
        nbytes = GaugeMetricFamily(
            "kvatlas_coordinator_directory_bytes", "Bytes held by tier", labels=["tier"]
        )
        for tier, n in sorted(s.bytes_by_tier.items()):
            nbytes.add_metric([tier], n)
        live = GaugeMetricFamily(
            "kvatlas_coordinator_live_instances",
            "Registered live instances",
            value=s.live_instances,
        )
        prov = GaugeMetricFamily(
            "kvatlas_coordinator_provisional_instances",
            "Instances known only from their events (not registered)",
            value=s.provisional_instances,
        )
        departed = GaugeMetricFamily(
            "kvatlas_coordinator_departed_instances",
            "Instances gone (deregistered or expired) whose L2 placements wait out"
            " --l2-retention-s",
            value=s.departed_instances,
        )
        age = GaugeMetricFamily(
            "kvatlas_coordinator_heartbeat_age_seconds",
            "Seconds since each live instance's last heartbeat",
            labels=["instance_id"],
        )
        for iid, a in s.heartbeat_age.items():
            age.add_metric([iid], a)
        gaps = GaugeMetricFamily(
            "kvatlas_coordinator_instance_seq_gaps",
            "Seq gaps seen in each instance's event stream",
            labels=["instance_id"],
        )
        missing = GaugeMetricFamily(
            "kvatlas_coordinator_instance_missing_seqs",
            "Seqs skipped in total in each instance's event stream",
            labels=["instance_id"],
        )
        dropped = GaugeMetricFamily(
            "kvatlas_coordinator_instance_events_dropped",
            "Events each instance reported dropping before they reached the coordinator"
            " (LMCache 0.5.7's dropped_events), in total",
            labels=["instance_id"],
        )
        for iid, n in s.gaps.items():
            gaps.add_metric([iid], n)
            missing.add_metric([iid], s.missing.get(iid, 0))
            dropped.add_metric([iid], s.dropped.get(iid, 0))
        chunk = GaugeMetricFamily(
            "kvatlas_coordinator_chunk_size",
            'Tokens per chunk the coordinator hashes token ids with; bound="0": the'
            " configured minimum, no server has bound it yet",
            labels=["bound"],
        )
        chunk.add_metric(["1" if s.chunk_size_bound else "0"], s.chunk_size)
        blend = GaugeMetricFamily(
            "kvatlas_coordinator_blend_chunks", "Chunks in the blend index", value=s.blend_chunks
        )
        tokens = GaugeMetricFamily(
            "kvatlas_coordinator_directory_token_bytes",
            "Bytes of the chunk token ids kept for lookups (4 per token)",
            value=s.token_bytes,
        )
        capacity = GaugeMetricFamily(
            "kvatlas_coordinator_declared_capacity_bytes",
            "Capacity each instance declared per tier and backend (config batches)",
            labels=["instance_id", "tier", "backend"],
        )
        for instance, tier, backend, n in s.declared_capacity:
            capacity.add_metric([instance, tier, backend], n)
        return [
            keys, placements, nbytes, live, prov, departed, age, gaps, missing, dropped, blend,
            tokens, capacity, chunk,
        ]  # fmt: skip


class _EdgeCollector(Collector):
    def __init__(self, sample: Callable[[], EdgeStats]) -> None:
        self._sample = sample

    def collect(self) -> Iterable[Metric]:
        s = self._sample()
        conns = GaugeMetricFamily(
            "kvatlas_coordinator_http_connections",
            "Open HTTP connections being served",
            value=s.connections,
        )
        buffered = GaugeMetricFamily(
            "kvatlas_coordinator_http_buffered_bytes",
            "Request body bytes reserved from the buffered-bytes budget now",
            value=s.buffered_bytes,
        )
        budget = GaugeMetricFamily(
            "kvatlas_coordinator_http_max_buffered_bytes",
            "The buffered-bytes budget (--max-buffered-bytes)",
            value=s.max_buffered_bytes,
        )
        refused = CounterMetricFamily(
            "kvatlas_coordinator_http_refused",
            "Requests and connections the HTTP server refused on its own, by cause"
            " (408: header_deadline, body_rate; 503: connections, buffered_bytes)",
            labels=["cause"],
        )
        for cause, n in s.refused.items():
            refused.add_metric([cause], n)
        return [conns, buffered, budget, refused]


class _MemoCollector(Collector):
    """The token hash chain's memo (`--token-hash-memo-bytes`), read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        links = CounterMetricFamily(
            "kvatlas_coordinator_token_hash_memo_links",
            "Links of the token hash chain looked for in its memo, by result (hit: the hash"
            " taken from it; miss: hashed)",
            labels=["result"],
        )
        links.add_metric(["hit"], s["hits"])
        links.add_metric(["miss"], s["misses"])
        busy = CounterMetricFamily(
            "kvatlas_coordinator_token_hash_memo_busy",
            "Lookups that found the memo in use by another thread and hashed without it",
            value=s["busy"],
        )
        size = GaugeMetricFamily(
            "kvatlas_coordinator_token_hash_memo_bytes",
            "Memory the memo may fill (its pages are mapped as it fills)",
            value=s["bytes"],
        )
        return [links, busy, size]


class _GcCollector(Collector):
    def __init__(self, pauses: GcPauses) -> None:
        self._pauses = pauses

    def collect(self) -> Iterable[Metric]:
        p = self._pauses
        runs = CounterMetricFamily(
            "kvatlas_coordinator_gc_collections",
            "Garbage collections by generation (every thread's requests wait for each)",
            labels=["generation"],
        )
        paused = CounterMetricFamily(
            "kvatlas_coordinator_gc_pause_seconds",
            "Seconds the process was paused by garbage collections, by generation",
            labels=["generation"],
        )
        longest = GaugeMetricFamily(
            "kvatlas_coordinator_gc_longest_pause_seconds",
            "The longest garbage-collection pause so far, by generation",
            labels=["generation"],
        )
        for g, (n, s, m) in enumerate(zip(p.collections, p.seconds, p.longest, strict=True)):
            runs.add_metric([str(g)], n)
            paused.add_metric([str(g)], s)
            longest.add_metric([str(g)], m)
        frozen = GaugeMetricFamily(
            "kvatlas_coordinator_gc_frozen_objects",
            "Objects moved out of the collector's sight at startup (gc.freeze)",
            value=gc.get_freeze_count(),
        )
        return [runs, paused, longest, frozen]


class CoordinatorMetrics:
    """The coordinator's metrics; one instance per app, with its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.tenant_registry = CollectorRegistry(auto_describe=False)
        """Families labelled by ``cache_salt`` (a tenant's identity): `render` adds them
        only for a caller who may see tenants (`auth.OperatorCheck.sees_tenants`)."""
        r = self.registry
        self.ingest_batches = Counter(
            "kvatlas_coordinator_ingest_batches",
            "Event batches by outcome (applied, skipped, duplicate, stale, invalid)",
            ["outcome", "transport"],
            registry=r,
        )
        self.ingest_entries = Counter(
            "kvatlas_coordinator_ingest_entries",
            "Event entries by batch outcome",
            ["outcome", "transport"],
            registry=r,
        )
        self.config_batches = Counter(
            "kvatlas_coordinator_config_batches",
            "Capacity declarations (config batches) applied",
            ["transport"],
            registry=r,
        )
        self.skipped_batches = Counter(
            "kvatlas_coordinator_skipped_batches",
            "Batches of event types this coordinator does not know, skipped after the gate"
            " (their seqs count), by type (the first 32 types; later ones are 'other')",
            ["event_type", "transport"],
            registry=r,
        )
        # A build without a C compiler reads JSON token arrays slower: say which.
        Gauge(
            "kvatlas_coordinator_json_token_parser",
            "The parser of JSON token_ids arrays in lookups: 1 for the one in use"
            " (compiled, or numpy where the C extension was not built)",
            ["parser"],
            registry=r,
        ).labels(DEFAULT_PARSER_NAME).set(1)
        # A build without the BLAKE3 C sources hashes token chunks slower: say which.
        Gauge(
            "kvatlas_coordinator_token_chain",
            "The blake3 prefix chain of lookups by tokens: 1 for the one in use"
            " (compiled, or python where the C extension was not built)",
            ["chain"],
            registry=r,
        ).labels(DEFAULT_CHAIN_NAME).set(1)
        self.ingest_gaps = Counter(
            "kvatlas_coordinator_ingest_gaps",
            "Batches that showed lost events: after a seq gap, or reporting more events"
            " dropped by their sender",
            registry=r,
        )
        self.ingest_missing = Counter(
            "kvatlas_coordinator_ingest_missing_seqs", "Seqs skipped by gaps", registry=r
        )
        self.ingest_events_dropped = Counter(
            "kvatlas_coordinator_ingest_events_dropped",
            "Events senders reported dropping before they reached the coordinator (the"
            " rises of LMCache 0.5.7's dropped_events)",
            registry=r,
        )
        self.chunk_size_binds = Counter(
            "kvatlas_coordinator_chunk_size_binds",
            "Chunk size bindings asked for (PUT /config/chunk-size, a registration's"
            " chunk_size), by outcome: bound, same (already bound to it), refused (409)",
            ["outcome"],
            registry=r,
        )
        self.fences = Counter(
            "kvatlas_coordinator_fences",
            "L1 slices fenced, by reason",
            ["reason"],
            registry=r,
        )
        self.fenced_placements = Counter(
            "kvatlas_coordinator_fenced_placements",
            "Placements removed by fences (L1 only) and drops (every tier: reasons"
            " expired_unregistered and l2_retention), by reason",
            ["reason"],
            registry=r,
        )
        self.expiries = Counter(
            "kvatlas_coordinator_expiries", "Instances expired for silence", registry=r
        )
        self.registrations = Counter(
            "kvatlas_coordinator_registrations",
            "Registrations by result",
            ["result"],
            registry=r,
        )
        self.refusals = Counter(
            "kvatlas_coordinator_instance_refusals",
            "Requests about an instance refused by its credential or the cursor bounds, by"
            " request (register, heartbeat, deregister, events) and reason"
            " (unauthenticated, wrong_credential, out_of_bounds)",
            ["request", "reason", "transport"],
            registry=r,
        )
        self.lookup_seconds = Histogram(
            "kvatlas_coordinator_lookup_seconds",
            "Directory lookup latency inside the coordinator, by kind",
            ["kind"],
            buckets=_LOOKUP_BUCKETS,
            registry=r,
        )
        self.kafka_records = Counter(
            "kvatlas_coordinator_kafka_records",
            "Kafka records consumed, by kind (batch, membership, undecodable, refused)",
            ["kind"],
            registry=r,
        )
        self.kafka_lag = Gauge(
            "kvatlas_coordinator_kafka_lag",
            "Records between the consumer position and the high watermark",
            ["partition"],
            registry=r,
        )
        self.snapshot_seconds = Histogram(
            "kvatlas_coordinator_snapshot_seconds",
            "Time to encode and write a snapshot",
            buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.snapshot_lock_seconds = Histogram(
            "kvatlas_coordinator_snapshot_lock_seconds",
            "Time the state was locked to copy it for a snapshot (ingest and lookups wait)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.snapshot_failures = Counter(
            "kvatlas_coordinator_snapshot_failures",
            "Snapshot writes that failed (each is logged; the next interval retries)",
            registry=r,
        )
        self.snapshot_bytes = Gauge(
            "kvatlas_coordinator_snapshot_bytes", "Size of the last snapshot", registry=r
        )

    def attach_state(self, sample: Callable[[], StateSample]) -> None:
        """Register the scrape-time collector reading ``sample()``."""
        self.registry.register(_StateCollector(sample))

    def attach_edge(self, sample: Callable[[], EdgeStats]) -> None:
        """Register the scrape-time collector of the HTTP server's ``sample()``."""
        self.registry.register(_EdgeCollector(sample))

    def attach_cpu_latency(self, us: int) -> None:
        """Say which CPU wake-up latency this process holds (`--cpu-latency-us`)."""
        Gauge(
            "kvatlas_coordinator_cpu_latency_hold_us",
            "The CPU wake-up latency limit this coordinator holds (--cpu-latency-us;"
            " absent without one)",
            registry=self.registry,
        ).set(us)

    def attach_memo(self, stats: Callable[[], dict[str, int]]) -> None:
        """Register the scrape-time collector of the token hash chain's memo."""
        self.registry.register(_MemoCollector(stats))

    def attach_gc(self, pauses: GcPauses) -> None:
        """Register the scrape-time collector of the process's garbage-collection pauses."""
        self.registry.register(_GcCollector(pauses))

    def render(self, tenants: bool = True) -> bytes:
        """The exposition text; with ``tenants``, the per-salt families too."""
        text = generate_latest(self.registry)
        return text + generate_latest(self.tenant_registry) if tenants else text

    def counters(self) -> CoordinatorCounters:
        """The totals of the counters (and the Kafka lag), summed over the labels the
        page does not show; reads only these metrics, never the state collector."""
        return CoordinatorCounters(
            batches=_totals(self.ingest_batches, "outcome", "_total"),
            entries=_totals(self.ingest_entries, "outcome", "_total"),
            lookups=_totals(self.lookup_seconds, "kind", "_count"),
            gaps=sum(_totals(self.ingest_gaps, "", "_total").values()),
            missing_seqs=sum(_totals(self.ingest_missing, "", "_total").values()),
            fences=_totals(self.fences, "reason", "_total"),
            expiries=sum(_totals(self.expiries, "", "_total").values()),
            kafka_records=_totals(self.kafka_records, "kind", "_total"),
            kafka_lag=_totals(self.kafka_lag, "partition", ""),
        )


def _totals(metric: Collector, label: str, suffix: str) -> dict[str, float]:
    """Sample values of ``metric`` whose name ends in ``suffix`` ("" for a gauge's own
    samples), summed by the value of ``label``."""
    out: dict[str, float] = {}
    for family in metric.collect():
        name = family.name + suffix
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out
