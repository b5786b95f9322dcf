"""The /status document: one JSON-able dict built from the parts' stats snapshots.

Owns the field names operators and tests read. Must not: hold state or take the store
lock for long (it copies snapshots and returns).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvatlas.server.p2p.node import P2PStats
from kvatlas.server.publisher import PublisherStats
from kvatlas.server.registrar import RegistrarStats, RegistrationState
from kvatlas.server.storage.chunkstore import ChunkStoreStats


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
    p2p: P2PStats | None = None,
) -> dict[str, Any]:
    l1 = store.l1
    return {
        "instance_id": instance_id,
        "incarnation": incarnation,
        "uptime_s": round(uptime_s, 3),
        "engine_port": engine_port,
        "http_port": http_port,
        "chunk_size": chunk_size,
        "registration_state": (
            registrar.state.value if registrar else RegistrationState.UNREGISTERED.value
        ),
        "coordinator": asdict(registrar) if registrar else None,
        "l1": {
            "region_name": region_name,
            "capacity_bytes": l1.capacity_bytes,
            "used_bytes": l1.used_bytes,
            "free_bytes": l1.free_bytes,
            "chunks": l1.chunks,
            "writing": l1.writing,
            "evictions": l1.evictions,
            "largest_free_bytes": l1.largest_free_bytes,
        },
        "l2": {
            "enabled": store.l2_capacity_bytes > 0,
            "capacity_bytes": store.l2_capacity_bytes,
            "used_bytes": store.l2_used_bytes,
            "promotions": store.promotions,
            "promotion_failures": store.promotion_failures,
            "demotions": store.demotions,
            "demotion_failures": store.demotion_failures,
        },
        "leases": {"read": l1.read_leases, "write": l1.write_leases},
        "events": {
            "transport": event_transport if publisher else "none",
            "pending": (publisher.pending_entries if publisher else 0),
            "buffered_batches": publisher.buffered_batches if publisher else 0,
            "sent_batches": publisher.sent_batches if publisher else 0,
            "sent_events": publisher.sent_entries if publisher else 0,
            "retries": publisher.retried_batches if publisher else 0,
            "failed_sends": publisher.failed_sends if publisher else 0,
            "dropped_batches": publisher.dropped_batches if publisher else 0,
            "dropped_events": publisher.dropped_entries if publisher else 0,
            "last_seq": publisher.last_seq if publisher else 0,
            "last_error": publisher.last_error if publisher else "",
        },
        "models": models,
        "engines": engines,
        **p2p_fields(p2p),
    }


def p2p_fields(p2p: P2PStats | None) -> dict[str, Any]:
    """The ``p2p_*`` fields (LMCache's names first, then kvatlas' counters)."""
    if p2p is None:
        return {
            "p2p_enabled": False,
            "p2p_state": "unregistered",
            "p2p_peer_count": 0,
            "p2p_peers": [],
            "active_p2p_lookup_jobs": 0,
        }
    f = p2p.fetch
    return {
        "p2p_enabled": True,
        "p2p_state": p2p.state.value,
        "p2p_peer_count": len(p2p.peers),
        "p2p_peers": list(p2p.peers),
        "active_p2p_lookup_jobs": p2p.active_lookup_jobs,
        "p2p": {
            "transfer_engine": p2p.transfer_engine,
            "advertise_url": p2p.advertise_url,
            "transfer_url": p2p.transfer_url,
            "lookups": f.lookups,
            "chunks_fetched": f.chunks_fetched,
            "bytes_read": f.bytes_read,
            "lock_requests": f.locks_requested,
            "directory_lookups": f.directory_lookups,
            "directory_failures": f.directory_failures,
            "all_peer_fallbacks": f.all_peer_fallbacks,
            "fallbacks": dict(f.fallbacks),
            "cooling_peers": list(p2p.cooling_peers),
            "served_locks": p2p.served_locks,
            "served_chunks": p2p.served_chunks,
            "served_unlocks": p2p.served_unlocks,
            "refused_requests": p2p.refused_requests,
            "adapters_added": p2p.adapters_added,
            "adapters_removed": p2p.adapters_removed,
            "adapters_rebuilt": p2p.adapters_rebuilt,
        },
    }
