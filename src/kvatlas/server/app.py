"""The cache server's composition root: builds, names, starts and stops every part.

Parts, in start order: incarnation (state dir) -> L1 region + pool -> L2 (disk, optional)
-> chunk store -> coordinator client, event publisher + sink and registrar (only with a
coordinator URL) -> guarded store (the store's lock and event drain) -> engine service
and P2P store access (two facades over it) -> engine API (ZeroMQ, --port) -> HTTP
(/status, /metrics, /healthz, --http-port) -> P2P (with --p2p-advertise-url: control
channel, the transport built from the config by ``kvatlas.transfer.factory`` serving the
region, controller; its endpoint goes into the registration) -> lease sweeper.
Ports are bound before any background thread starts, so a taken port fails the start
with PortInUse. Stop runs in reverse: engines first, then P2P, a last event flush,
deregistration, HTTP, and the region is unlinked; a stop that hangs all the same
dumps every thread's stack to the log after ``STOP_STACKS_S``.

One `CoordinatorClient` serves every part that talks to the coordinator (registrar,
HTTP event sink, P2P controller and fetcher): httpx.Client is thread-safe, so they share
one keep-alive pool, one list of replica URLs (and the replica in use: when one part's
request fails over, the others follow) and one token, and their requests keep the one
timeout they all had (``--coordinator-timeout-s``, per replica; the fetcher lowers it per
lookup to its deadline). A failover is told to the registrar, which registers on the new
replica, and when the replicas share no log (events over HTTP) resyncs there. The root
closes the client after the last user, the deregistration.

Must not: parse flags or read the environment (``kvatlas.cli.server`` does), or hold
business logic (the parts do).
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import secrets
import signal
import threading
import time
from dataclasses import replace
from types import FrameType

from kvatlas.core.errors import ConfigError
from kvatlas.core.events import Entry
from kvatlas.core.server.l1pool import L1Pool
from kvatlas.core.types import EventType, Tier
from kvatlas.runtime.asgi_thread import AsgiThread
from kvatlas.runtime.coordinator_client import CoordinatorClient, Failover
from kvatlas.runtime.periodic import Periodic
from kvatlas.runtime.region import SHM_DIR, L1Region, RegionBusy
from kvatlas.server.cache_control import CacheControl
from kvatlas.server.cache_metrics import CacheControlCollector
from kvatlas.server.config import GIB, P2PConfig, ServerConfig, split_host_port
from kvatlas.server.engine_api import EngineApi
from kvatlas.server.engine_service import EngineService, ServiceIdentity
from kvatlas.server.http_app import build_app
from kvatlas.server.http_cache import cache_routes
from kvatlas.server.incarnation import load_secret, next_incarnation, save_secret
from kvatlas.server.kv_events import Fanout, KvEventsCollector, KvEventsPublisher
from kvatlas.server.lease_ids import RandomLeaseIds
from kvatlas.server.lmcache_mp.metrics import LMCacheMPCollector
from kvatlas.server.lmcache_mp.service import LMCacheMPService, MpIdentity
from kvatlas.server.lmcache_mp.transport import LMCacheMPHandler
from kvatlas.server.metrics import ServerMetrics
from kvatlas.server.p2p.node import P2PNode
from kvatlas.server.p2p.store_access import PeerStoreAccess
from kvatlas.server.publisher import EventPublisher
from kvatlas.server.registrar import Identity, Registrar
from kvatlas.server.sinks import EventSink, HttpSink, KafkaSink
from kvatlas.server.status import build_status
from kvatlas.server.storage.chunkstore import ChunkStore
from kvatlas.server.storage.guarded import GuardedStore
from kvatlas.server.storage.l1_journal import (
    L1Journal,
    WarmStart,
    cold,
    discard_kept,
    journal_path,
    kept_region_name,
    recover,
    superblock_for,
)
from kvatlas.server.storage.l2 import L2Adapter
from kvatlas.server.storage.l2_disk import DiskL2Adapter
from kvatlas.server.warm_metrics import WarmStartCollector
from kvatlas.transfer.config import NixlConfig, ShmConfig, TcpConfig
from kvatlas.transfer.factory import TransportConfig, make_transport
from kvatlas.wire.fleet_view import HEARTBEAT_INTERVAL_KEY, STATUS_URL_KEY, status_url
from kvatlas.wire.server_status import ServerStatus
from kvatlas.wire.vllm_events import MEMBER_KEY

log = logging.getLogger(__name__)

DEFAULT_L2_BYTES = 10 * GIB
SWEEP_INTERVAL_S = 1.0
STOP_STACKS_S = 10.0
"""A stop still running after this long dumps every thread's stack to stderr."""


def make_sink(config: ServerConfig, coordinator: CoordinatorClient) -> EventSink:
    ev = config.events
    if ev.transport == "kafka":
        return KafkaSink(
            ev.kafka.bootstrap_servers,
            ev.kafka.topic,
            timeout_s=10.0,
            partitioner=ev.kafka.partitioner,
            proof=coordinator.instance_proof,
        )
    return HttpSink(coordinator, fmt=ev.http_format)


def transport_config(p2p: P2PConfig) -> TransportConfig:
    """The transport's own config from the P2P settings: tcp binds the listen host at
    ``--p2p-data-port`` and announces the advertise host; mooncake names the advertise
    host; shm and nixl take their defaults."""
    listen = split_host_port(p2p.bind_url)
    advertise = split_host_port(p2p.advertise_url or "")
    if listen is None or advertise is None:  # validate() refused these already
        raise ConfigError("--p2p-advertise-url and --p2p-listen-url must be HOST:PORT")
    if p2p.transport == "tcp":
        return TcpConfig(host=listen[0], port=p2p.data_port, advertise_host=advertise[0])
    if p2p.transport == "shm":
        return ShmConfig()
    if p2p.transport == "mooncake":
        return replace(p2p.mooncake, host=advertise[0])
    return NixlConfig()


class CacheServer:
    """One ``kvatlas server`` process."""

    def __init__(self, config: ServerConfig) -> None:
        config.validate()
        self.config = config
        self.started_at = time.monotonic()
        self.incarnation = next_incarnation(config.state_dir, config.instance_id)
        self.region, existed = self._open_region()
        self.coordinator: CoordinatorClient | None = None
        self.journal: L1Journal | None = None
        try:
            # Random lease ids: a client cannot end a lease it was not given.
            self.pool = L1Pool(
                config.l1.size_bytes,
                config.l1.align_bytes,
                config.l1.eviction_policy,
                lease_ids=RandomLeaseIds(),
                tenant_min_share=config.l1.tenant_min_share,
            )
            self.warm_start = self._recover(existed)
            self.l2: L2Adapter | None = None
            if config.l2.path is not None:
                self.l2 = DiskL2Adapter(config.l2.path, config.l2.size_bytes or DEFAULT_L2_BYTES)
            self.store = ChunkStore(self.pool, self.region, self.l2, self.journal)
            self.publisher: EventPublisher | None = None
            self.registrar: Registrar | None = None
            co = config.coordinator
            if co.urls:
                self.coordinator = CoordinatorClient(
                    co.urls,
                    auth_token=co.auth_token,
                    timeout_s=co.request_timeout_s,
                    name=f"instance {config.instance_id} incarnation {self.incarnation}",
                    on_failover=self._on_failover,
                )
                # The last start's secret proves this start's registration (after a crash).
                self.coordinator.set_instance_secret(
                    load_secret(config.state_dir, config.instance_id)
                )
                self.publisher = EventPublisher(
                    make_sink(config, self.coordinator),
                    config.instance_id,
                    self.incarnation,
                    flush_interval_s=config.events.flush_interval_s,
                    buffer_batches=config.events.buffer_batches,
                    max_batch_entries=config.events.max_batch_entries,
                    on_loss_recovered=self._resync,
                )
            self.kv_events = (  # vLLM-format KV events of L1/L2 (--kv-events-endpoint)
                KvEventsPublisher(config.kv_events, config.chunk_size, on_loss=self._resync)
                if config.kv_events.endpoint
                else None
            )
            self.guarded = GuardedStore(
                self.store, publisher=Fanout.of(self.publisher, self.kv_events)
            )
            self.service = EngineService(
                self.guarded,
                ServiceIdentity(
                    config.instance_id, self.incarnation, config.chunk_size, config.lease_s
                ),
                p2p_slots=config.engine_p2p_workers,
                on_prompt=self.kv_events.learn_prompt if self.kv_events is not None else None,
            )
            # LMCache 0.5.6's MP protocol on the same --port (told apart by framing).
            self.lmcache = LMCacheMPService(
                self.guarded,
                MpIdentity(config.instance_id, self.incarnation, config.chunk_size, config.lease_s),
                prefetch_workers=max(1, config.engine_p2p_workers),
                transfer_mode=config.lmcache_transfer_mode,
                on_prompt=self.kv_events.learn_prompt if self.kv_events is not None else None,
            )
            self.lmcache_mp = LMCacheMPHandler(self.lmcache, refusal=self._lmcache_refusal())
            # The /cache/* routes a coordinator drives (delete, warm prefetch, usage).
            self.cache_control = CacheControl(
                self.guarded, config.chunk_size, contracts=self.service.contracts
            )
            self.engine_api = EngineApi(
                self.service,
                config.host,
                config.port,
                workers=config.engine_workers,
                p2p_workers=config.engine_p2p_workers if config.p2p.enabled else 0,
                max_queued=config.engine_max_queued,
                max_queued_per_client=config.engine_max_queued_per_client,
                auth_token=config.coordinator.auth_token,
                second=self.lmcache_mp,
            )
            self.engine_api.start()  # binds --port: PortInUse before anything else runs
            try:
                self.http = AsgiThread(
                    config.host, config.http_port, what="HTTP", flag="--http-port"
                )
            except BaseException:
                self.engine_api.stop()
                raise
            self.p2p: P2PNode | None = None
            if config.p2p.enabled:
                try:
                    self.p2p = self._build_p2p()
                except BaseException:
                    self.engine_api.stop()
                    self.http.stop()
                    raise
                self.service.set_peer_source(self.p2p.fetcher)
                self.lmcache.set_peer_source(self.p2p.fetcher)
                self.cache_control.set_peer_source(self.p2p.fetcher)
            if self.coordinator is not None:
                self.registrar = Registrar(
                    self.coordinator,
                    Identity(
                        config.instance_id,
                        self.incarnation,
                        co.advertise_ip,
                        http_port=self.http.port,
                        mq_port=self.engine_api.bound_port,
                        p2p_advertised_url=config.p2p.advertise_url,
                        engine_urls=co.engine_urls,
                        metadata={
                            # Where the coordinator's fleet page reads this server.
                            STATUS_URL_KEY: status_url(co.advertise_ip, self.http.port),
                            HEARTBEAT_INTERVAL_KEY: str(co.heartbeat_interval_s),
                            **(self.p2p.registration_metadata() if self.p2p else {}),
                            # the node's vLLM engines' KV events (--engine-kv-events)
                            **(
                                {MEMBER_KEY: ";".join(co.engine_kv_events)}
                                if co.engine_kv_events
                                else {}
                            ),
                        },
                    ),
                    heartbeat_interval_s=co.heartbeat_interval_s,
                    on_resync=self._resync,
                    # Over HTTP each replica keeps its own directory (no shared log): a
                    # replica failed over to must be told everything this server holds.
                    resync_on_failover=config.events.transport == "http",
                    # 256 random bits per process start; only its digest leaves.
                    secret=secrets.token_urlsafe(32),
                    on_secret=functools.partial(save_secret, config.state_dir, config.instance_id),
                )
                self.service.set_contract_declarer(self.registrar.declare_contract)
                self.lmcache.set_contract_declarer(self.registrar.declare_contract)
                self.service.set_engine_advertiser(self.registrar.advertise_engine)
            self.metrics = ServerMetrics(
                config.instance_id,
                self.guarded.stats,
                lambda: self.publisher.stats() if self.publisher else None,
                lambda: self.registrar.stats() if self.registrar else None,
                lambda: (self.service.requests, self.service.errors),
                coordinator=lambda: self.coordinator.stats() if self.coordinator else None,
                lookups=self.service.lookup_counts,
                p2p=lambda: self.p2p.stats() if self.p2p else None,
                engine_api=self.engine_api.stats,
                extra=[LMCacheMPCollector(config.instance_id, self.lmcache_mp)],
            )
            self.metrics.registry.register(
                CacheControlCollector(config.instance_id, self.cache_control.stats)
            )
            if self.kv_events is not None:
                self.metrics.registry.register(
                    KvEventsCollector(config.instance_id, self.kv_events.stats)
                )
            self.metrics.registry.register(
                WarmStartCollector(config.instance_id, self.warm_start, lambda: self.journal)
            )
        except BaseException:
            if self.coordinator is not None:
                self.coordinator.close()
            self._close_region()
            raise
        self._sweeper = Periodic(
            "kvatlas-sweeper",
            SWEEP_INTERVAL_S,
            self.service.expire,
            what=f"the lease sweep of instance {config.instance_id}",
        )

    def _open_region(self) -> tuple[L1Region, bool]:
        """The L1 region, and whether it is a kept one found with its bytes (a warm
        restart may then serve them): kept across starts with ``--l1-warm-restart``, else
        fresh (and a region an earlier start kept is removed, freeing its memory)."""
        l1, iid = self.config.l1, self.config.instance_id
        kept_name = kept_region_name(iid, self.config.state_dir)
        if l1.warm_restart:
            region, existed = L1Region.keep(kept_name, l1.size_bytes)
        else:
            if discard_kept(kept_name):
                log.info("removed the L1 region %s an earlier start kept", kept_name)
            region, existed = L1Region.create(l1.size_bytes, iid), False
        if existed:  # its pages exist; checking the kept chunks maps theirs
            log.info("L1 region %s: %.2f GiB found", region.name, l1.size_bytes / 2**30)
        elif l1.prefault:
            t0 = time.monotonic()
            region.prefault()
            log.info(
                "L1 region %s: %.2f GiB reserved (pages touched in %.2f s)",
                region.name,
                l1.size_bytes / 2**30,
                time.monotonic() - t0,
            )
        return region, existed

    def _recover(self, existed: bool) -> WarmStart:
        """Restore the pool from a kept region and start its journal (warm restart)."""
        config = self.config
        if not self.region.kept:
            return cold("--no-l1-warm-restart")
        path = journal_path(self.region.name)
        block = superblock_for(config.instance_id, config.state_dir, self.region.size, self.pool)
        found = (
            recover(
                self.region, path, block, self.pool, now=time.monotonic(), hold_s=config.lease_s
            )
            if existed
            else cold("no region kept (a first start, another --l1-size-gb, or a reboot)")
        )
        self.journal = L1Journal(path, block, self.pool.slots())
        if self.journal.broken:
            log.warning("L1 journal off, the next start will be cold: %s", self.journal.broken)
        log.info(
            "L1 %s start of instance %s incarnation %d: %s; kept %d chunks (%.2f GiB, checked"
            " in %.2f s), dropped %d corrupt and %d unsealed%s",
            "warm" if found.warm else "cold",
            config.instance_id,
            self.incarnation,
            found.reason,
            found.chunks,
            found.bytes / 2**30,
            found.verify_s,
            found.corrupt,
            found.unsealed,
            ", journal tail torn" if found.torn else "",
        )
        return found

    def _lmcache_refusal(self) -> str | None:
        """Why LMCache MP requests are refused on this server (None: they are served)."""
        mode = self.config.lmcache_mp
        token = bool(self.config.coordinator.auth_token)
        if mode == "off":
            return "the LMCache MP protocol is off on this kvatlas server (--lmcache-mp off)"
        if mode == "auto" and token:
            return (
                "this kvatlas server requires --auth-token and LMCache clients send none"
                " (start it with --lmcache-mp on to admit them)"
            )
        if token:
            log.warning(
                "--lmcache-mp on with --auth-token: LMCache clients on --port are admitted"
                " without a token (they cannot send one)"
            )
        return None

    def _build_p2p(self) -> P2PNode:
        config = self.config
        co = config.coordinator
        assert self.coordinator is not None  # validate(): P2P requires a coordinator
        # TransportUnavailable (a package missing, a port taken) goes up as it is.
        transport = make_transport(config.p2p.transport, transport_config(config.p2p))
        return P2PNode(
            config=config.p2p,
            instance_id=config.instance_id,
            incarnation=self.incarnation,
            chunk_size=config.chunk_size,
            store=PeerStoreAccess(self.guarded),
            region=self.region,
            transport=transport,
            coordinator=self.coordinator,
            heartbeat_interval_s=co.heartbeat_interval_s,
            coordinator_timeout_s=co.request_timeout_s,
            auth_token=co.auth_token,
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()  # binds first: ConfigError before anything runs
        self.http.start(
            build_app(
                self.status,
                self._render_metrics,
                self.config.coordinator.auth_token,
                cache_routes(
                    self.cache_control,
                    self.config.coordinator.auth_token,
                    self.lmcache.kv_checksums if self.config.lmcache_mp != "off" else None,
                ),
            ),
            name="kvatlas-http",
        )
        if self.p2p is not None:
            self.p2p.start()
        if self.guarded.publisher is not None:  # the coordinator's, KV events' or both
            self.guarded.drain()  # the chunks a warm start kept in L1: STORE, "restored"
            l2_items = self.store.startup_l2_events()
            if l2_items:
                self.guarded.publisher.publish(
                    EventType.STORE, Tier.L2, [Entry(e.key, e.size) for e in l2_items]
                )
        if self.publisher is not None:
            self.publisher.start()
        if self.registrar is not None:
            self.registrar.start()
        self._sweeper.start()
        log.info(
            "cache server %s incarnation %d up: engine API tcp://%s:%d, HTTP :%d, L1 %d bytes"
            " (%s), L2 %s, coordinator %s",
            self.config.instance_id,
            self.incarnation,
            self.config.host,
            self.engine_api.bound_port,
            self.http.port,
            self.pool.capacity_bytes,
            self.region.name,
            self.config.l2.path or "off",
            ", ".join(self.config.coordinator.urls) or "none (standalone)",
        )

    def _on_failover(self, event: Failover) -> None:
        # Called in the thread whose request failed over; the registrar only takes note.
        if self.registrar is not None:
            self.registrar.replica_changed(event.to_url)

    def _resync(self) -> None:
        self.service.resync()
        if self.publisher is not None:
            self.publisher.flush_soon()

    def stop(self) -> None:
        self.engine_api.stop()
        self.lmcache.close()
        self._sweeper.stop()
        self.cache_control.close()
        if self.p2p is not None:
            self.service.set_peer_source(None)
            self.lmcache.set_peer_source(None)
            self.cache_control.set_peer_source(None)
            self.p2p.stop()
        self.guarded.drain()
        if self.publisher is not None:
            self.publisher.stop(final_flush=True)
        if self.kv_events is not None:
            self.kv_events.stop()
        if self.registrar is not None:
            self.registrar.stop(deregister=True)
        if self.coordinator is not None:
            self.coordinator.close()
        self.http.stop(10.0)
        if self.l2 is not None:
            self.l2.close()
        self._close_region()
        log.info(
            "cache server %s incarnation %d stopped", self.config.instance_id, self.incarnation
        )

    def _close_region(self) -> None:
        if self.journal is not None:
            self.journal.close()
        try:
            self.region.close()
        except RegionBusy:
            log.warning("L1 region %s still had views at shutdown", self.region.name)
        if not self.region.kept:
            self.region.unlink()
            return
        log.info(
            "L1 region %s kept for a warm restart (%.2f GiB in /dev/shm): start again with"
            " the same --instance-id and --state-dir to serve it, or remove %s* to free it",
            self.region.name,
            self.region.size / 2**30,
            SHM_DIR / self.region.name,
        )

    def run(self) -> None:
        """Start, serve until SIGTERM or SIGINT, stop."""
        done = threading.Event()

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %d: stopping instance %s", signum, self.config.instance_id)
            done.set()

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            done.wait()
        finally:
            # Each step of stop() is bounded; should one still hang, every thread's
            # stack goes to stderr (the log) so that the operator sees where.
            faulthandler.dump_traceback_later(STOP_STACKS_S, exit=False)
            try:
                self.stop()
            finally:
                faulthandler.cancel_dump_traceback_later()
                for s, handler in old.items():
                    signal.signal(s, handler)

    # ------------------------------------------------------------------ observability

    def status(self) -> ServerStatus:
        store = self.guarded.stats()
        return build_status(
            instance_id=self.config.instance_id,
            incarnation=self.incarnation,
            engine_port=self.engine_api.bound_port,
            http_port=self.http.port,
            chunk_size=self.config.chunk_size,
            region_name=self.region.name,
            store=store,
            registrar=self.registrar.stats() if self.registrar else None,
            publisher=self.publisher.stats() if self.publisher else None,
            event_transport=self.config.events.transport,
            models=sorted(self.service.contracts()),
            engines=self.service.engines(),
            uptime_s=time.monotonic() - self.started_at,
            lookups=self.service.lookup_counts(),
            p2p=self.p2p.stats() if self.p2p else None,
            cache_control=self.cache_control.stats(),
        )

    def _render_metrics(self) -> bytes:
        return self.metrics.render()
