"""The storage stats of a cache server, each written once: its ``/status`` field and its
``kvatlas_server_l1_*``, ``l2_*`` or lease metric (``server.stat_table`` generates both).

`L1_STATS` (``l1``), `LEASE_STATS` (``leases``), `L2_STATS` (``l2``) and `SALT_STATS`
(``l1_by_salt``, labelled by the salt: "" is the unsalted namespace), read from a
``ChunkStoreStats`` snapshot and the L1 pool's ``PoolStats`` in it.

Must not: count, or format a stat anywhere but in its row.
"""

from __future__ import annotations

from typing import Final

from kvatlas.core.server.l1pool import PoolStats
from kvatlas.core.server.l1shares import SaltUsage
from kvatlas.server.stat_table import COUNTER, GAUGE, Each, Field, Stat, Table
from kvatlas.server.storage.chunkstore import ChunkStoreStats
from kvatlas.wire.server_status import L1SaltStatus

_L1 = Stat[PoolStats]
_L2 = Stat[ChunkStoreStats]
_SALT = Stat[SaltUsage]

L1_STATS: Final = Table[PoolStats](
    (
        _L1(
            "capacity_bytes",
            "kvatlas_server_l1_capacity_bytes",
            GAUGE,
            "Usable bytes of the L1 region.",
            lambda p: p.capacity_bytes,
        ),
        _L1(
            "used_bytes",
            "kvatlas_server_l1_used_bytes",
            GAUGE,
            "Bytes of L1 held by chunks.",
            lambda p: p.used_bytes,
        ),
        _L1("free_bytes", None, GAUGE, "Free bytes of L1.", lambda p: p.free_bytes),
        _L1(
            "chunks",
            "kvatlas_server_l1_chunks",
            GAUGE,
            "Committed chunks in L1.",
            lambda p: p.chunks,
        ),
        _L1("writing", None, GAUGE, "Writes in progress into L1.", lambda p: p.writing),
        _L1(
            "evictions",
            "kvatlas_server_l1_evictions",
            COUNTER,
            "Chunks evicted from L1.",
            lambda p: p.evictions,
        ),
        _L1(
            "largest_free_bytes",
            None,
            GAUGE,
            "The largest free extent of L1.",
            lambda p: p.largest_free_bytes,
        ),
        _L1(
            "cross_salt_evictions",
            "kvatlas_server_l1_cross_salt_evictions",
            COUNTER,
            "L1 evictions that took another cache_salt's chunk than the allocating request's.",
            lambda p: p.cross_salt_evictions,
        ),
        _L1(
            "tenant_share_bytes",
            "kvatlas_server_l1_tenant_share_bytes",
            GAUGE,
            "L1 bytes each active cache_salt is guaranteed now (--l1-tenant-min-share, cut"
            " down to the equal split); 0: per-tenant shares are off.",
            lambda p: p.tenant_share_bytes,
        ),
    )
)
"""``l1``; its ``region_name`` is given by the caller (the region's, not the pool's)."""

LEASE_STATS: Final = Table[PoolStats](
    (
        _L1(
            "read",
            "kvatlas_server_read_leases",
            GAUGE,
            "Live read leases.",
            lambda p: p.read_leases,
        ),
        _L1(
            "write",
            "kvatlas_server_write_leases",
            GAUGE,
            "Live write leases.",
            lambda p: p.write_leases,
        ),
    )
)

L2_STATS: Final = Table[ChunkStoreStats](
    (
        Field("enabled", lambda s: s.l2_capacity_bytes > 0),
        _L2(
            "capacity_bytes",
            "kvatlas_server_l2_capacity_bytes",
            GAUGE,
            "Byte budget of L2.",
            lambda s: s.l2_capacity_bytes,
        ),
        _L2(
            "used_bytes",
            "kvatlas_server_l2_used_bytes",
            GAUGE,
            "Bytes of L2 files.",
            lambda s: s.l2_used_bytes,
        ),
        _L2(
            "promotions",
            "kvatlas_server_l2_promotions",
            COUNTER,
            "Chunks promoted from L2 into L1.",
            lambda s: s.promotions,
        ),
        _L2(
            "promotion_failures",
            None,
            COUNTER,
            "Promotions from L2 that failed.",
            lambda s: s.promotion_failures,
        ),
        _L2(
            "demotions",
            "kvatlas_server_l2_demotions",
            COUNTER,
            "Evicted L1 chunks written to L2.",
            lambda s: s.demotions,
        ),
        _L2(
            "demotion_failures",
            None,
            COUNTER,
            "Evicted L1 chunks that could not be written to L2.",
            lambda s: s.demotion_failures,
        ),
    )
)

SALT_STATS: Final = Each(
    Table[SaltUsage](
        (
            _SALT(
                "bytes",
                "kvatlas_server_l1_salt_bytes",
                GAUGE,
                "Reserved L1 bytes a cache_salt holds (committed chunks and writes in progress).",
                lambda u: u.bytes,
            ),
            _SALT(
                "chunks",
                "kvatlas_server_l1_salt_chunks",
                GAUGE,
                "Committed L1 chunks of a cache_salt.",
                lambda u: u.chunks,
            ),
            _SALT(
                "evicted_by_own",
                None,
                COUNTER,
                "Its chunks evicted to make room for its own requests.",
                lambda u: u.evicted_by_own,
            ),
            _SALT(
                "evicted_by_others",
                None,
                COUNTER,
                "Its chunks evicted to make room for other cache_salts' requests.",
                lambda u: u.evicted_by_others,
            ),
            _SALT(
                None,
                "kvatlas_server_l1_salt_evictions",
                COUNTER,
                "A cache_salt's L1 chunks evicted, by whose request made room: own (the same"
                " salt's) or other (another salt's).",
                lambda u: {"own": u.evicted_by_own, "other": u.evicted_by_others},
                label="by",
            ),
        )
    ),
    L1SaltStatus,
    "salt",
    lambda u: u.cache_salt,
)
