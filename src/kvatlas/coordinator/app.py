"""Composition root of `kvatlas coordinator`: builds and names every part, runs them.

Builds, in order: metrics, the fleet state (restored from the snapshot when there is
one), the service, the quota controller (its operator state and L2 usage book restored
from beside the snapshot), the membership frontend (direct, or through Kafka with the consumer
and the publisher), the fleet L2 eviction loop, the device tier (the vLLM ingest, its
lookup route and, with `--kv-indexer-api`, the indexer API with the workers registered
before a restart), the HTTP app, the snapshot writer and the expiry loop; then serves
HTTP (`coordinator.edge`: uvloop, httptools) on a socket it bound itself (so
a port of 0 is known before serving) until told to stop (SIGINT/SIGTERM or `stop()`),
and on a clean shutdown writes a last snapshot (`final_snapshot_failed` says whether
that failed, for the exit status). Run in the main thread it owns the process: it takes
the signals, freezes what startup built out of the garbage collector's sight and sets
glibc's malloc thresholds (`host.allocator`). Must not contain logic of its own
beyond wiring.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Protocol

from kvatlas.coordinator import snapshot
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.host.allocator import keep_freed_heap
from kvatlas.coordinator.host.cpu_latency import CpuLatencyError, CpuLatencyHold
from kvatlas.coordinator.http.app import CoordinatorApp, RouteSet
from kvatlas.coordinator.http.auth import OperatorCheck
from kvatlas.coordinator.http.cache import CacheMetrics, CacheRoutes, ControllerPins
from kvatlas.coordinator.http.edge.server import HttpServer
from kvatlas.coordinator.http.quota import LocalOperatorLog, OperatorLog, QuotaRoutes
from kvatlas.coordinator.indexer.api import IndexerApi
from kvatlas.coordinator.indexer.registry import book_path, load_book
from kvatlas.coordinator.ingest.frontend import LocalMembership, MembershipFrontend
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.quota import store as quota_store
from kvatlas.coordinator.quota.controller import QuotaController
from kvatlas.coordinator.quota.eviction_loop import EvictionLoop
from kvatlas.coordinator.quota.metrics import QuotaMetrics
from kvatlas.coordinator.server_control import ServerControl
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.vllm.ingest import VllmIngest
from kvatlas.coordinator.vllm.routes import DeviceLookupRoute
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.errors import ConfigError, InvalidInput
from kvatlas.core.keys import DEFAULT_CHAIN_NAME, ChainMemo, chain_memo
from kvatlas.runtime.extras import needs_extra
from kvatlas.runtime.gc_pauses import GcPauses
from kvatlas.runtime.net import bind
from kvatlas.runtime.periodic import Periodic
from kvatlas.wire.json_tokens import DEFAULT_PARSER_READER

log = logging.getLogger(__name__)


class _Part(Protocol):
    """What the root starts besides HTTP (Kafka consumer, publisher)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class Coordinator:
    """One coordinator process, wired."""

    def __init__(self, config: CoordinatorConfig, clock: Callable[[], float] = time.time) -> None:
        config.validate()
        self.config = config
        self.clock = clock
        self.metrics = CoordinatorMetrics()
        self.gc_pauses = GcPauses()
        self.metrics.attach_gc(self.gc_pauses)
        kafka = config.event_transport == "kafka"
        # With Kafka, restored instances keep their heartbeat times from the log (every
        # replica must agree on them); alone, each gets a full timeout from now.
        restored = snapshot.load(config, None if kafka else clock())
        if restored is None:
            fleet = FleetState(
                config.instance_timeout,
                config.chunk_size,
                config.enable_blend_lookup,
                keep_tokens=not config.drop_token_ids,
                l2_retention=config.l2_retention_s,
            )
            positions: dict[str, int] = {}
        else:
            fleet, positions = restored
        self.memo = _token_hash_memo(config.token_hash_memo_bytes, fleet.chunk_size)
        self.service = CoordinatorService(
            fleet,
            self.metrics,
            clock=clock,
            timer=time.perf_counter,
            bounds=config.bounds(),
            memo=self.memo,
        )
        if self.memo is not None:
            self.metrics.attach_memo(self.memo.stats)
        self.service.state.positions.update(positions)
        self.metrics.attach_state(self.service.views.sample)
        operator_state, usage = quota_store.load(config.snapshot_path)
        quota_metrics = QuotaMetrics(self.metrics.registry)
        self.quotas = QuotaController(
            self.service,
            quota_metrics,
            operator_path=quota_store.operator_path(config.snapshot_path),
            operator=operator_state,
            usage=usage,
            ratio=config.eviction_ratio,
            watermark=config.trigger_watermark,
        )
        quota_metrics.attach(
            self.metrics.registry, self.metrics.tenant_registry, self.quotas.sample
        )
        operator_log: OperatorLog
        self._parts: list[_Part] = []
        self.membership: MembershipFrontend
        events_refusal = ""
        if kafka:
            # Imported here because confluent-kafka is an optional dependency
            # (`kvatlas[kafka]`); a coordinator on HTTP alone must run without it.
            with needs_extra("kafka", "--event-transport kafka"):
                from kvatlas.coordinator.ingest.kafka_wiring import build_kafka  # noqa: PLC0415

            self.membership, parts = build_kafka(
                config, self.service, self.metrics, clock, self.quotas
            )
            self._parts.extend(parts)
            operator_log = self.membership
            events_refusal = (
                f"this coordinator takes events from Kafka topic {config.kafka_topic};"
                " publish batches there so that every replica sees them"
            )
        else:
            self.membership = LocalMembership(self.service, clock)
            self.service.readiness.set_ready()
            operator_log = LocalOperatorLog(self.quotas)
        # The cache-control routes' client of servers: used on the HTTP loop, closed there.
        cache_metrics = CacheMetrics(self.metrics.registry)
        # The eviction loop's own (its thread has its own event loop), counted alike.
        self.eviction = EvictionLoop(
            self.quotas,
            lambda: ServerControl(
                auth_token=config.auth_token or None, observe=cache_metrics.observe
            ),
            config.eviction_check_interval,
        )
        self._parts.append(self.eviction)
        server_control = ServerControl(
            auth_token=config.auth_token or None, observe=cache_metrics.observe
        )
        self.vllm: VllmIngest | None = None
        extra_routes: list[RouteSet] = []
        # Read before anything opens sockets: an unreadable file refuses the start.
        indexer_book = book_path(config.snapshot_path) if config.kv_indexer_api else None
        indexer_kept = load_book(indexer_book)
        if config.vllm_kv_events or config.vllm_kv_events_from_members or config.kv_indexer_api:
            self.vllm = VllmIngest(
                config.vllm_kv_events,
                members=(
                    (
                        lambda: [
                            (i.instance_id, i.metadata)
                            for i in self.service.views.instances(clock())
                        ]
                    )
                    if config.vllm_kv_events_from_members
                    else None
                ),
            )
            self.vllm.attach(self.metrics.registry)
            self._parts.append(self.vllm)
            extra_routes.append(DeviceLookupRoute(self.vllm, config.max_lookup_tokens))
            if config.kv_indexer_api:
                # A part after the ingest: its start subscribes again to the workers
                # registered before a restart, once the ingest runs.
                indexer = IndexerApi(
                    self.vllm,
                    tenant_names=config.tenant_names,
                    max_tokens=config.max_lookup_tokens,
                    max_hashes=config.max_lookup_keys,
                    book=indexer_book,
                    kept=indexer_kept,
                    operator=OperatorCheck(config.operator_token),
                )
                indexer.attach(self.metrics.registry)
                self._parts.append(indexer)
                extra_routes.append(indexer)
        self.http: HttpServer = CoordinatorApp(
            config,
            self.service,
            self.membership,
            self.metrics,
            clock=clock,
            events_refusal=events_refusal,
            gc_pauses=self.gc_pauses,
            quotas=QuotaRoutes(
                self.quotas, self.service, operator_log, OperatorCheck(config.operator_token)
            ),
            cache=CacheRoutes(
                self.service,
                server_control,
                cache_metrics,
                OperatorCheck(config.operator_token),
                ControllerPins(self.quotas, operator_log),
            ),
            extra_routes=extra_routes,
        ).server()
        self.http.closers.append(server_control.aclose)
        self.metrics.attach_edge(self.http.stats)
        self.snapshots = (
            snapshot.SnapshotWriter(
                self.service, Path(config.snapshot_path), config.snapshot_interval, self.metrics
            )
            if config.snapshot_path
            else None
        )
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._expiry = Periodic(
            "expiry",
            config.health_check_interval,
            self.membership.sweep,
            what="the expiry sweep",
        )
        self.final_snapshot_failed = False
        """True when the snapshot written at shutdown failed: a restart loses state."""
        self.cpu_latency = _cpu_latency_hold(config.cpu_latency_us)
        if self.cpu_latency is not None:
            self.metrics.attach_cpu_latency(self.cpu_latency.us)

    def bind(self) -> int:
        """Bind the HTTP socket now; returns the port (useful with port 0)."""
        if self._sock is None:
            sock = bind(self.config.host, self.config.port, "coordinator HTTP", "--port")
            sock.listen(2048)
            sock.set_inheritable(True)
            self._sock = sock
        port: int = self._sock.getsockname()[1]
        return port

    def run(self) -> None:
        """Serve until stopped; blocking. Writes the last snapshot on the way out."""
        port = self.bind()
        assert self._sock is not None
        if self._stop.is_set():
            self.http.stop()
        if threading.current_thread() is threading.main_thread():
            # Stop on SIGINT/SIGTERM by leaving the serve loop, so that the process
            # lives on to write its last snapshot.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._on_signal)
            # The process is ours: move what startup built (modules, the restored state)
            # out of the collector's sight. A full collection visited them all, adding
            # its pause to the requests in flight at each one (docs/benchmarks.md).
            gc.collect()
            gc.freeze()
            # And keeps freed heap for the next request's big temporaries (see there).
            keep_freed_heap()
        self.gc_pauses.install()
        for part in self._parts:
            part.start()
        if self.snapshots is not None:
            self.snapshots.start()
        self._expiry.start()
        memo = self.memo.stats() if self.memo is not None else None
        log.info(
            "Coordinator listening on %s:%d (events over %s; JSON token arrays read by"
            " the %s parser, tokens hashed by the %s chain, %s; %s)",
            self.config.host,
            port,
            self.config.event_transport,
            DEFAULT_PARSER_READER,
            DEFAULT_CHAIN_NAME,
            f"with a memo of {memo['links']} links in {memo['bytes'] / 2**20:.1f} MiB"
            if memo is not None
            else "without a memo",
            f"holding the CPUs' wake-up latency to {self.cpu_latency.us} us"
            if self.cpu_latency is not None
            else "no CPU latency hold",
        )
        try:
            self.http.run(self._sock)
        finally:
            self.shutdown()

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.stop()

    def stop(self) -> None:
        """Ask the server to stop (thread-safe)."""
        self._stop.set()
        self.http.stop()

    def shutdown(self) -> None:
        self._stop.set()
        self.gc_pauses.remove()
        self._expiry.stop(timeout_s=None)
        if self.snapshots is not None:
            self.snapshots.stop()
        for part in reversed(self._parts):
            part.stop()
        if self.snapshots is not None and not self.snapshots.try_write():
            self.final_snapshot_failed = True
            log.error(
                "Last snapshot to %s failed at shutdown: a restart restores the last one"
                " written before it, and loses every change since",
                self.config.snapshot_path,
            )
        if self._sock is not None:
            self._sock.close()
        if self.cpu_latency is not None:
            self.cpu_latency.close()
        log.info("Coordinator stopped")


def _cpu_latency_hold(us: int | None) -> CpuLatencyHold | None:
    """The PM QoS hold of `--cpu-latency-us`, or None without the flag."""
    if us is None:
        return None
    try:
        return CpuLatencyHold(us)
    except CpuLatencyError as exc:
        raise ConfigError(f"--cpu-latency-us: {exc}") from exc


def _token_hash_memo(max_bytes: int, chunk_size: int) -> ChainMemo | None:
    """The memo of the token hash chain (`--token-hash-memo-bytes`), keyed afresh in
    every process; None when off or where the compiled chain was not built."""
    try:
        return chain_memo(chunk_size, max_bytes, os.urandom(32))
    except InvalidInput as exc:
        raise ConfigError(f"--token-hash-memo-bytes: {exc} (0: no memo)") from exc
