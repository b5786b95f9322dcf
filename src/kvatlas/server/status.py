"""The /status document: one `wire.server_status.ServerStatus` built from the parts'
stats snapshots.

Owns the mapping from the parts' stats to the document's fields (the shapes and their
names are ``wire.server_status``'s). Must not: hold state or take the store lock for
long (it copies snapshots and returns).
"""

from __future__ import annotations

from kvatlas.server.cache_control import CacheControlStats
from kvatlas.server.engine_service import LookupCounts
from kvatlas.server.p2p.node import P2PStats
from kvatlas.server.publisher import PublisherStats
from kvatlas.server.registrar import RegistrarStats, RegistrationState
from kvatlas.server.storage.chunkstore import ChunkStoreStats
from kvatlas.wire.server_status import (
    CacheControlStatus,
    EventStatus,
    L1SaltStatus,
    L1Status,
    L2Status,
    LeaseStatus,
    LookupStatus,
    P2PStatus,
    PeerTimingStatus,
    RegistrarStatus,
    ServerStatus,
)


def build_status(
    *,
    instance_id: str,
    incarnation: int,
    engine_port: int,
    http_port: int,
    chunk_size: int,
    region_name: str,
    store: ChunkStoreStats,
    registrar: RegistrarStats | None,
    publisher: PublisherStats | None,
    event_transport: str,
    models: list[str],
    engines: int,
    uptime_s: float,
    lookups: LookupCounts,
    p2p: P2PStats | None = None,
    cache_control: CacheControlStats | None = None,
) -> ServerStatus:
    l1 = store.l1
    return ServerStatus(
        instance_id=instance_id,
        incarnation=incarnation,
        uptime_s=round(uptime_s, 3),
        engine_port=engine_port,
        http_port=http_port,
        chunk_size=chunk_size,
        registration_state=(
            registrar.state.value if registrar else RegistrationState.UNREGISTERED.value
        ),
        coordinator=registrar_status(registrar) if registrar else None,
        l1=L1Status(
            region_name=region_name,
            capacity_bytes=l1.capacity_bytes,
            used_bytes=l1.used_bytes,
            free_bytes=l1.free_bytes,
            chunks=l1.chunks,
            writing=l1.writing,
            evictions=l1.evictions,
            largest_free_bytes=l1.largest_free_bytes,
            cross_salt_evictions=l1.cross_salt_evictions,
            tenant_share_bytes=l1.tenant_share_bytes,
        ),
        l2=L2Status(
            enabled=store.l2_capacity_bytes > 0,
            capacity_bytes=store.l2_capacity_bytes,
            used_bytes=store.l2_used_bytes,
            promotions=store.promotions,
            promotion_failures=store.promotion_failures,
            demotions=store.demotions,
            demotion_failures=store.demotion_failures,
        ),
        leases=LeaseStatus(read=l1.read_leases, write=l1.write_leases),
        events=event_status(publisher, event_transport),
        models=models,
        engines=engines,
        lookups=LookupStatus(
            requests=lookups.lookups,
            chunks=lookups.chunks,
            hit_chunks=lookups.hit_chunks,
            peer_chunks=lookups.peer_chunks,
            recompute_s_per_token=dict(lookups.recompute_s_per_token),
            learned_estimates=lookups.learned_estimates,
            flag_estimates=lookups.flag_estimates,
        ),
        p2p_enabled=p2p is not None,
        p2p_state=p2p.state.value if p2p else "unregistered",
        p2p_peer_count=len(p2p.peers) if p2p else 0,
        p2p_peers=list(p2p.peers) if p2p else [],
        active_p2p_lookup_jobs=p2p.active_lookup_jobs if p2p else 0,
        p2p=p2p_status(p2p) if p2p else None,
        cache_control=cache_control_status(cache_control) if cache_control else None,
        l1_by_salt={
            u.cache_salt: L1SaltStatus(u.bytes, u.chunks, u.evicted_by_own, u.evicted_by_others)
            for u in store.l1_by_salt
        },
    )


def cache_control_status(c: CacheControlStats) -> CacheControlStatus:
    return CacheControlStatus(
        prefetch_jobs=c.jobs,
        prefetches=dict(c.prefetches),
        prefetch_keys=dict(c.prefetch_keys),
        delete_requests=c.delete_requests,
        deleted_l1=c.deleted_l1,
        deleted_l2=c.deleted_l2,
        skipped_locked=c.skipped_locked,
    )


def registrar_status(r: RegistrarStats) -> RegistrarStatus:
    return RegistrarStatus(
        state=r.state.value,
        registrations=r.registrations,
        heartbeats=r.heartbeats,
        heartbeat_failures=r.heartbeat_failures,
        reregistrations_after_404=r.reregistrations_after_404,
        resyncs=r.resyncs,
        contracts=list(r.contracts),
        last_error=r.last_error,
        url=r.url,
        failovers=r.failovers,
    )


def event_status(publisher: PublisherStats | None, transport: str) -> EventStatus:
    """The publisher's counters; zeros and transport ``none`` without one."""
    if publisher is None:
        return EventStatus("none", 0, 0, 0, 0, 0, 0, 0, 0, 0, "")
    return EventStatus(
        transport=transport,
        pending=publisher.pending_entries,
        buffered_batches=publisher.buffered_batches,
        sent_batches=publisher.sent_batches,
        sent_events=publisher.sent_entries,
        retries=publisher.retried_batches,
        failed_sends=publisher.failed_sends,
        dropped_batches=publisher.dropped_batches,
        dropped_events=publisher.dropped_entries,
        last_seq=publisher.last_seq,
        last_error=publisher.last_error,
        rejected_batches=publisher.rejected_batches,
    )


def p2p_status(p2p: P2PStats) -> P2PStatus:
    """kvatlas' P2P counters (the ``p2p`` object)."""
    f = p2p.fetch
    return P2PStatus(
        transfer_engine=p2p.transport,
        advertise_url=p2p.advertise_url,
        transfer_url=p2p.transfer_url,
        lookups=f.lookups,
        chunks_fetched=f.chunks_fetched,
        bytes_read=f.bytes_read,
        lock_requests=f.locks_requested,
        directory_lookups=f.directory_lookups,
        directory_failures=f.directory_failures,
        all_peer_fallbacks=f.all_peer_fallbacks,
        fallbacks={cause.value: n for cause, n in f.fallbacks.items()},
        cooling_peers=list(p2p.cooling_peers),
        served_locks=p2p.served_locks,
        served_chunks=p2p.served_chunks,
        served_unlocks=p2p.served_unlocks,
        served_reads=p2p.served_reads,
        refused_requests=p2p.refused_requests,
        adapters_added=p2p.adapters_added,
        adapters_removed=p2p.adapters_removed,
        adapters_rebuilt=p2p.adapters_rebuilt,
        polls=p2p.polls,
        poll_failures=p2p.poll_failures,
        no_holder=f.no_holder,
        breakers_opened=p2p.breakers_opened,
        probes=p2p.probes,
        lock_deadline_prior_ms=p2p.lock_deadline_prior_s * 1000,
        promoting_locks=f.promoting_locks,
        fleet_rpc_p99_ms=_ms(p2p.fleet_rpc_p99_s),
        peer_timings=[
            PeerTimingStatus(
                peer=t.peer,
                rpc_samples=t.rpc_samples,
                rpc_p99_ms=_ms(t.rpc_p99_s),
                bandwidth_mib_s=(
                    None if t.bandwidth_bps is None else round(t.bandwidth_bps / 2**20, 3)
                ),
                lock_deadline_ms=round(t.lock_deadline_s * 1000, 3),
                last_lock_deadline_ms=_ms(t.last_lock_deadline_s),
                last_load_deadline_ms=_ms(t.last_load_deadline_s),
            )
            for t in p2p.timings
        ],
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
