"""Prometheus metrics of the cache server, read from stats snapshots at scrape time.

Owns the metric names (prefix ``kvatlas_server_``) and a per-process CollectorRegistry.
A custom collector asks the parts for ``stats()`` when scraped, so the hot paths count
nothing extra. Must not: be imported for side effects or touch the global registry.
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
from kvatlas.server.publisher import PublisherStats
from kvatlas.server.registrar import RegistrarStats, RegistrationState
from kvatlas.server.storage.chunkstore import ChunkStoreStats

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

    def _g(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        return instance_gauge(self._iid, name, doc, value)

    def _c(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        return instance_counter(self._iid, name, doc, value)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._store()
        yield self._g("l1_capacity_bytes", "Usable bytes of the L1 region.", s.l1.capacity_bytes)
        yield self._g("l1_used_bytes", "Bytes of L1 held by chunks.", s.l1.used_bytes)
        yield self._g("l1_chunks", "Committed chunks in L1.", s.l1.chunks)
        yield self._g("read_leases", "Live read leases.", s.l1.read_leases)
        yield self._g("write_leases", "Live write leases.", s.l1.write_leases)
        yield self._c("l1_evictions", "Chunks evicted from L1.", s.l1.evictions)
        yield from _salt_metrics(self._iid, s)
        yield self._g("l2_capacity_bytes", "Byte budget of L2.", s.l2_capacity_bytes)
        yield self._g("l2_used_bytes", "Bytes of L2 files.", s.l2_used_bytes)
        yield self._c("l2_promotions", "Chunks promoted from L2 into L1.", s.promotions)
        yield self._c("l2_demotions", "Evicted L1 chunks written to L2.", s.demotions)
        req, err = self._requests()
        yield self._c("engine_requests", "Engine API requests served.", req)
        yield self._c("engine_request_errors", "Engine API requests answered with an error.", err)
        ea = self._engine_api()
        if ea is not None:
            yield self._g(
                "engine_requests_queued", "Engine requests held now (queued or served).", ea.queued
            )
            yield self._g(
                "engine_clients_queued", "Engine sockets with requests held now.", ea.clients_queued
            )
            yield self._c(
                "engine_requests_overloaded",
                "Engine requests answered 'overloaded' at once, unserved: --engine-max-queued"
                " or --engine-max-queued-per-client was full.",
                ea.overloaded,
            )
        yield self._wire_unknown(ea, self._p2p())
        lk = self._lookups()
        yield self._c("lookups", "Engine lookups.", lk.lookups)
        yield self._c("lookup_chunks", "Chunks engines looked up.", lk.chunks)
        yield self._c("lookup_hit_chunks", "Looked-up chunks answered as hits.", lk.hit_chunks)
        yield self._c("lookup_peer_chunks", "Hit chunks read from peers.", lk.peer_chunks)
        rates = GaugeMetricFamily(
            "kvatlas_server_engine_recompute_seconds_per_token",
            "Prefill seconds per token the model's engines reported (or implied by their"
            " recompute estimates); it bounds the peer wait of lookups without an estimate.",
            labels=["instance_id", "model"],
        )
        for model, rate in lk.recompute_s_per_token.items():
            rates.add_metric([self._iid, model], rate)
        yield rates
        yield self._c(
            "lookup_learned_estimates",
            "Lookups without a recompute estimate bounded by a learned engine rate.",
            lk.learned_estimates,
        )
        yield self._c(
            "lookup_flag_estimates",
            "Lookups without a recompute estimate and no learned rate: bounded by the"
            " --p2p-*-recompute-s-per-token flags.",
            lk.flag_estimates,
        )
        pub = self._publisher()
        if pub is not None:
            yield self._c("events_sent", "Cache events delivered.", pub.sent_entries)
            yield self._c("event_batches_sent", "Event batches delivered.", pub.sent_batches)
            yield self._c("event_batches_retried", "Batches sent again.", pub.retried_batches)
            yield self._c("event_send_failures", "Failed event sends.", pub.failed_sends)
            yield self._c("events_dropped", "Events dropped: buffer full.", pub.dropped_entries)
            yield self._c(
                "event_batches_rejected",
                "Batches sent for the first time that the coordinator answered as duplicate"
                " or stale (another sender speaks for this instance).",
                pub.rejected_batches,
            )
            yield self._g("event_batches_buffered", "Unsent batches.", pub.buffered_batches)
            yield self._g("events_pending", "Events not yet batched.", pub.pending_entries)
        reg = self._registrar()
        if reg is not None:
            yield self._g(
                "registered",
                "1 when registered with the coordinator.",
                1 if reg.state is RegistrationState.REGISTERED else 0,
            )
            yield self._c("resyncs", "Resyncs after the coordinator lost state.", reg.resyncs)
        co = self._coordinator()
        if co is not None:
            yield from self._coordinator_metrics(co)
        pp = self._p2p()
        if pp is not None:
            yield from self._p2p_metrics(pp)

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

    def _coordinator_metrics(
        self, co: ClientStats
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield self._c(
            "coordinator_failovers", "Moves to another coordinator replica.", co.failovers
        )
        yield self._g(
            "coordinator_replicas_skipped",
            "Coordinator replicas skipped after failing (breaker open).",
            sum(1 for r in co.replicas if r.skipped_for_s > 0),
        )
        failures = CounterMetricFamily(
            "kvatlas_server_coordinator_replica_failures",
            "Requests to a coordinator replica that got no answer or a 5xx.",
            labels=["instance_id", "url"],
        )
        in_use = GaugeMetricFamily(
            "kvatlas_server_coordinator_replica_in_use",
            "1 for the coordinator replica in use, 0 for the others.",
            labels=["instance_id", "url"],
        )
        for r in co.replicas:
            failures.add_metric([self._iid, r.url], r.failures)
            in_use.add_metric([self._iid, r.url], 1 if r.url == co.url else 0)
        yield failures
        yield in_use

    def _p2p_metrics(self, pp: P2PStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        f = pp.fetch
        yield self._g("active_p2p_lookup_jobs", "P2P fetches in progress.", pp.active_lookup_jobs)
        yield self._g("p2p_peers", "Peers with a P2P adapter.", len(pp.peers))
        yield self._c("p2p_lookups", "Local misses that asked peers.", f.lookups)
        yield self._c("p2p_chunks_fetched", "Chunks read from peers into L1.", f.chunks_fetched)
        yield self._c("p2p_bytes_read", "Bytes read from peers.", f.bytes_read)
        yield self._c("p2p_served_chunks", "Chunks locked for peers.", pp.served_chunks)
        yield self._c(
            "p2p_directory_failures", "Directory lookups that failed.", f.directory_failures
        )
        yield self._c(
            "p2p_blind_lookups",
            "Lookups that asked a few peers blindly: the directory could not be asked.",
            f.all_peer_fallbacks,
        )
        yield self._c(
            "p2p_no_holder", "Local misses the directory named no holder for.", f.no_holder
        )
        yield self._g("p2p_peers_down", "Peers whose breaker is open.", len(pp.cooling_peers))
        yield self._c("p2p_breakers_opened", "Times a peer's breaker opened.", pp.breakers_opened)
        yield self._c(
            "p2p_promoting_locks",
            "Lock RPCs to a peer holding some of the keys in L2 only (they wait the lookup's"
            " remaining time, not the peer's learned lock deadline).",
            f.promoting_locks,
        )
        yield from _deadline_metrics(self._iid, pp)
        fb = CounterMetricFamily(
            "kvatlas_server_p2p_fallbacks",
            "P2P failures that became a recompute, by cause.",
            labels=["instance_id", "cause"],
        )
        for cause, n in sorted(f.fallbacks.items()):
            fb.add_metric([self._iid, cause.value], n)
        yield fb


def _salt_metrics(
    iid: str, s: ChunkStoreStats
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Per cache_salt (the salt itself as the label; "" is the unsalted namespace): L1
    held, and evictions by the salt's own requests and by others'."""
    yield instance_counter(
        iid,
        "l1_cross_salt_evictions",
        "L1 evictions that took another cache_salt's chunk than the allocating request's.",
        s.l1.cross_salt_evictions,
    )
    yield instance_gauge(
        iid,
        "l1_tenant_share_bytes",
        "L1 bytes each active cache_salt is guaranteed now (--l1-tenant-min-share, cut"
        " down to the equal split); 0: per-tenant shares are off.",
        s.l1.tenant_share_bytes,
    )
    labels = ["instance_id", "salt"]
    held = GaugeMetricFamily(
        "kvatlas_server_l1_salt_bytes",
        "Reserved L1 bytes a cache_salt holds (committed chunks and writes in progress).",
        labels=labels,
    )
    chunks = GaugeMetricFamily(
        "kvatlas_server_l1_salt_chunks", "Committed L1 chunks of a cache_salt.", labels=labels
    )
    evicted = CounterMetricFamily(
        "kvatlas_server_l1_salt_evictions",
        "A cache_salt's L1 chunks evicted, by whose request made room: own (the same"
        " salt's) or other (another salt's).",
        labels=[*labels, "by"],
    )
    for u in s.l1_by_salt:
        held.add_metric([iid, u.cache_salt], u.bytes)
        chunks.add_metric([iid, u.cache_salt], u.chunks)
        evicted.add_metric([iid, u.cache_salt, "own"], u.evicted_by_own)
        evicted.add_metric([iid, u.cache_salt, "other"], u.evicted_by_others)
    yield held
    yield chunks
    yield evicted


def _deadline_metrics(iid: str, pp: P2PStats) -> Iterator[GaugeMetricFamily]:
    """Per peer: the lock and load deadlines its answers gave, and what they came from."""
    lock = GaugeMetricFamily(
        "kvatlas_server_p2p_lock_deadline_seconds",
        "What a lookup_and_lock to the peer waits now (its RPC p99 x a factor, at least"
        " the floor; the prior before it answered), before a lookup's recompute cap.",
        labels=["instance_id", "peer"],
    )
    load = GaugeMetricFamily(
        "kvatlas_server_p2p_load_deadline_seconds",
        "The deadline the peer's last load got (bytes / its bandwidth x a factor, capped"
        " by recompute and --p2p-load-timeout).",
        labels=["instance_id", "peer"],
    )
    p99 = GaugeMetricFamily(
        "kvatlas_server_p2p_peer_rpc_p99_seconds",
        "The p99 of the peer's control round trips (lock and unlock RPCs).",
        labels=["instance_id", "peer"],
    )
    bw = GaugeMetricFamily(
        "kvatlas_server_p2p_peer_bandwidth_bytes_per_second",
        "The EWMA of the peer's load bandwidth.",
        labels=["instance_id", "peer"],
    )
    for t in pp.timings:
        lock.add_metric([iid, t.peer], t.lock_deadline_s)
        if t.last_load_deadline_s is not None:
            load.add_metric([iid, t.peer], t.last_load_deadline_s)
        if t.rpc_p99_s is not None:
            p99.add_metric([iid, t.peer], t.rpc_p99_s)
        if t.bandwidth_bps is not None:
            bw.add_metric([iid, t.peer], t.bandwidth_bps)
    yield lock
    yield load
    yield p99
    yield bw
