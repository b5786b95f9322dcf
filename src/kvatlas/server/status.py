"""The /status document: one `wire.server_status.ServerStatus` built from the parts'
stats snapshots.

Owns the document's top: the process's identity and ports, and which sections it holds.
Each section's fields are generated from its stats table (``stat_rows``,
``p2p.stat_rows``, ``storage.stat_rows``, ``cache_metrics``), where each stat is written
once with its metric; the shapes are ``wire.server_status``'s. Must not: hold state or
take the store lock for long (it copies snapshots and returns).
"""

from __future__ import annotations

from kvatlas.server.cache_control import CacheControlStats
from kvatlas.server.cache_metrics import CACHE_CONTROL_STATS
from kvatlas.server.engine_service import LookupCounts
from kvatlas.server.p2p.node import P2PStats
from kvatlas.server.p2p.stat_rows import P2P_STATS, P2P_SUMMARY, p2p_off
from kvatlas.server.publisher import PublisherStats
from kvatlas.server.registrar import RegistrarStats, RegistrationState
from kvatlas.server.stat_rows import EVENT_STATS, LOOKUP_STATS, REGISTRAR_STATS
from kvatlas.server.storage.chunkstore import ChunkStoreStats
from kvatlas.server.storage.stat_rows import L1_STATS, L2_STATS, LEASE_STATS, SALT_STATS
from kvatlas.wire.server_status import (
    CacheControlStatus,
    EventStatus,
    L1Status,
    L2Status,
    LeaseStatus,
    LookupStatus,
    P2PStatus,
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
        coordinator=REGISTRAR_STATS.section(RegistrarStatus, registrar) if registrar else None,
        l1=L1_STATS.section(L1Status, l1, region_name=region_name),
        l2=L2_STATS.section(L2Status, store),
        leases=LEASE_STATS.section(LeaseStatus, l1),
        events=event_status(publisher, event_transport),
        models=models,
        engines=engines,
        lookups=LOOKUP_STATS.section(LookupStatus, lookups),
        p2p_enabled=p2p is not None,
        **(P2P_SUMMARY.fields(p2p) if p2p else p2p_off()),
        p2p=P2P_STATS.section(P2PStatus, p2p) if p2p else None,
        cache_control=(
            CACHE_CONTROL_STATS.section(CacheControlStatus, cache_control)
            if cache_control
            else None
        ),
        l1_by_salt=SALT_STATS.by_key(store.l1_by_salt),
    )


def event_status(publisher: PublisherStats | None, transport: str) -> EventStatus:
    """The publisher's counters; zeros and transport ``none`` without one."""
    if publisher is None:
        return EventStatus("none", 0, 0, 0, 0, 0, 0, 0, 0, 0, "")
    return EVENT_STATS.section(EventStatus, publisher, transport=transport)
