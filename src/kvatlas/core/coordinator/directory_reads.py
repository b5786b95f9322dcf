"""The key directory's reads: lookups, key listing, stats and the snapshot capture.

Owns ``DirectoryReads``, every question asked of the one ``DirectoryTables`` the
directory composes: placements of keys (by keys, by a hash blob, by a prefix chain), key
listing in steps, per-key facts, bytes per namespace, stats, and the capture a snapshot
encodes. Must not: change the tables (``DirectoryWrites`` applies events; the one thing
it fills is the tables' cache of decoded placement sets) or do any I/O.

It binds the tables its lookups touch to its own slots once (the tables are never
replaced), so the hot paths pay no more than an attribute of ``self`` for each.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from operator import attrgetter

import numpy as np

from kvatlas.core.coordinator.directory_snapshot import DirectoryCapture
from kvatlas.core.coordinator.directory_tables import DirectoryTables
from kvatlas.core.coordinator.placements import (
    HASH_BITS,
    HASH_MASK,
    SIZE_BITS,
    SIZE_MASK,
    DirectoryStats,
    KeyColumns,
    KeyResult,
    MapValue,
    Owner,
    OwnerStats,
    Placement,
    PrefixResult,
    decode_placements,
    prefix_holders,
)
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import HASH_BYTES, Namespace, ObjectKey, same_namespace
from kvatlas.core.types import ChunkHash, InstanceId, Tier

_CACHE_LIMIT = 65536
"""Decoded placement sets kept before the cache starts over."""

_get_hash = attrgetter("chunk_hash")


class DirectoryReads:
    """The lookups over one ``DirectoryTables``; part of ``KeyDirectory``, which is the
    object to use. Single-threaded."""

    __slots__ = (
        "_access",
        "_map",
        "_namespaces",
        "_ns_ids",
        "_owners",
        "_pl_cache",
        "_tables",
        "_tokens",
    )

    def __init__(self, tables: DirectoryTables) -> None:
        self._tables = tables
        # Direct references for the hot paths (the tables are never replaced).
        self._map: dict[int, MapValue] = tables.map
        self._owners: list[Owner] = tables.owners
        self._namespaces: list[Namespace] = tables.namespaces
        self._ns_ids: dict[tuple[str, int, int, str], int] = tables.ns_ids
        self._access: dict[int, int] = tables.access
        self._tokens: dict[int, tuple[int, bytes]] = tables.tokens
        self._pl_cache: dict[MapValue | None, tuple[Placement, ...]] = tables.pl_cache

    def _placements_of(self, cur: MapValue | None) -> tuple[Placement, ...]:
        if cur is None:
            return ()
        cached = self._pl_cache.get(cur)
        if cached is not None:
            return cached
        out = decode_placements(self._owners, cur)
        if len(self._pl_cache) >= _CACHE_LIMIT:
            self._pl_cache.clear()
            self._pl_cache[None] = ()
        self._pl_cache[cur] = placements = tuple(out)
        return placements

    def _placements(self, ik: int) -> tuple[Placement, ...]:
        return self._placements_of(self._map.get(ik))

    def _result(self, key: ObjectKey, ik: int | None) -> KeyResult:
        if ik is None:
            return KeyResult(key, ())
        cur = self._map.get(ik)
        if cur is None:
            return KeyResult(key, ())
        token_ids = None
        if self._tokens:
            tokens = self._tokens.get(ik)
            if tokens is not None:
                token_ids = tuple(array.array("I", tokens[1]))
        access = self._access.get(ik, 0) if self._access else 0
        return KeyResult(key, self._placements_of(cur), access, token_ids)

    def lookup_keys(self, keys: Iterable[ObjectKey]) -> list[KeyResult]:
        """Placements of each key, in the order given (empty placements: unknown)."""
        keys = list(keys)
        if not keys:
            return []
        blob = b"".join(map(_get_hash, keys))
        if len(blob) != HASH_BYTES * len(keys) or not same_namespace(keys):
            find_key, result = self._tables.find_key, self._result
            return [result(k, find_key(k)) for k in keys]
        # One namespace and full hashes, the common case: the blob lookup's C-level maps.
        cols = self.lookup_blob(blob, keys[0].namespace)
        tokens = cols.token_ids or (None,) * len(keys)
        return list(map(KeyResult, keys, cols.placements, cols.access_counts, tokens))

    def lookup_prefix(self, hashes: Sequence[ChunkHash], ns: Namespace) -> PrefixResult:
        """Per chunk of a prefix chain who holds it, and per (instance, tier) how many
        leading chunks it holds."""
        hashes = tuple(hashes)
        blob = b"".join(hashes)
        if len(blob) == HASH_BYTES * len(hashes):
            cols = self.lookup_blob(blob, ns)
        else:  # short hashes: the directory keys on the first 8 bytes
            cols = self._columns([int.from_bytes(h[:8], "big") for h in hashes], ns)
        return PrefixResult(
            ns,
            hashes,
            cols.placements,
            cols.access_counts,
            cols.token_ids,
            prefix_holders(cols.placements),
        )

    def lookup_blob(self, blob: bytes, ns: Namespace) -> KeyColumns:
        """Placements of each hash of ``blob`` (full hashes, concatenated) in ``ns``, in
        order: the keys form of a lookup, with no prefix to summarise."""
        if len(blob) % HASH_BYTES:
            raise InvalidInput(f"a hash blob must be a multiple of {HASH_BYTES} bytes")
        prefixes: list[int] = np.frombuffer(blob, dtype=">u8")[:: HASH_BYTES // 8].tolist()
        return self._columns(prefixes, ns)

    def _columns(self, prefixes: list[int], ns: Namespace) -> KeyColumns:
        n = len(prefixes)
        ns_id = self._tables.find_ns(ns)
        if ns_id is None or n == 0:
            return KeyColumns(((),) * n, (0,) * n, None)
        base = ns_id << HASH_BITS
        iks = [base | h for h in prefixes] if base else prefixes
        vals = list(map(self._map.get, iks))
        cached = list(map(self._pl_cache.get, vals))
        # A None means a placement set not seen since the cache was last cleared.
        placements: tuple[tuple[Placement, ...], ...] = (
            tuple(map(self._placements_of, vals)) if None in cached else tuple(cached)  # type: ignore[arg-type]
        )
        access = tuple(self._access.get(ik, 0) for ik in iks) if self._access else (0,) * n
        token_ids = None
        if self._tokens:
            token_ids = tuple(
                tuple(array.array("I", t[1])) if (t := self._tokens.get(ik)) else None for ik in iks
            )
        return KeyColumns(placements, access, token_ids)

    def iter_keys(
        self,
        tier: Tier | None = None,
        instance_id: InstanceId | None = None,
        backend: str | None = None,
    ) -> Iterator[tuple[Namespace, bytes, tuple[Placement, ...]]]:
        """Every key with its placements, filtered; the hash is the stored 8-byte prefix."""
        yield from self.key_rows(list(self._map), tier, instance_id, backend)

    def namespaces(self) -> list[Namespace]:
        """Every namespace that holds a key now."""
        return [self._namespaces[i] for i in self._ns_ids.values()]

    def key_order(self) -> list[int]:
        """Every key's id, in insertion order: a copy (one C-level pass), so a caller
        can walk it in steps while the directory changes in between."""
        return list(self._map)

    def key_slice(self, start: int, count: int) -> list[int]:
        """The ids of ``count`` keys from position ``start`` in insertion order; the
        skip runs in C (none past the end: islice takes no stop beyond sys.maxsize)."""
        if start >= len(self._map):
            return []
        return list(islice(self._map, start, start + count))

    def key_rows(
        self,
        ids: Iterable[int],
        tier: Tier | None = None,
        instance_id: InstanceId | None = None,
        backend: str | None = None,
    ) -> list[tuple[Namespace, bytes, tuple[Placement, ...]]]:
        """The keys of ``ids`` that still have a placement matching the filters, with
        those placements, in order."""
        rows = []
        unfiltered = tier is None and instance_id is None and backend is None
        for ik in ids:
            placements = self._placements(ik)
            if not unfiltered:
                placements = tuple(
                    p
                    for p in placements
                    if (tier is None or p.tier is tier)
                    and (instance_id is None or p.instance_id == instance_id)
                    and (backend is None or p.backend == backend)
                )
            if placements:
                ns = self._namespaces[ik >> HASH_BITS]
                rows.append((ns, (ik & HASH_MASK).to_bytes(8, "big"), placements))
        return rows

    def key_facts(self, ns: Namespace, prefix: bytes) -> tuple[int, int]:
        """(access count, number of kept token ids) of a listed key (0, 0 if gone)."""
        ns_id = self._tables.find_ns(ns)
        if ns_id is None:
            return 0, 0
        ik = ns_id << HASH_BITS | int.from_bytes(prefix, "big")
        bound = self._tokens.get(ik)
        return self._access.get(ik, 0), 0 if bound is None else len(bound[1]) // 4

    def tier_bytes(self, ids: Iterable[int], tier: Tier) -> dict[Namespace, int]:
        """Bytes of ``tier`` placements per namespace, over the keys of ``ids`` (what
        the quota routes sum per salt, read from the codes without making placements)."""
        tier_oids = {oid for oid, o in enumerate(self._owners) if o.tier is tier}
        out: dict[int, int] = {}
        for ik in ids:
            cur = self._map.get(ik)
            if cur is None:
                continue
            if isinstance(cur, int):
                n = cur & SIZE_MASK if cur >> SIZE_BITS in tier_oids else 0
            else:
                n = sum(c & SIZE_MASK for c in cur if c >> SIZE_BITS in tier_oids)
            if n:
                out[ik >> HASH_BITS] = out.get(ik >> HASH_BITS, 0) + n
        return {self._namespaces[ns]: b for ns, b in out.items()}

    # ---- stats, digest, snapshot -----------------------------------------------------

    def __len__(self) -> int:
        return len(self._map)

    def stats(self) -> DirectoryStats:
        by_tier_n = {t.value: 0 for t in Tier}
        by_tier_b = {t.value: 0 for t in Tier}
        owners = []
        counts, sizes = self._tables.owner_placements, self._tables.owner_bytes
        for oid, o in enumerate(self._owners):
            n, b = counts[oid], sizes[oid]
            if n == 0:
                continue
            by_tier_n[o.tier.value] += n
            by_tier_b[o.tier.value] += b
            owners.append(
                OwnerStats(o.instance_id, o.incarnation, o.tier, o.backend, n, b, o.shared)
            )
        return DirectoryStats(
            keys=len(self._map),
            placements=sum(by_tier_n.values()),
            bytes=sum(by_tier_b.values()),
            placements_by_tier=by_tier_n,
            bytes_by_tier=by_tier_b,
            owners=tuple(owners),
            namespaces=len(self._ns_ids),
            token_keys=len(self._tokens),
            token_bytes=self._tables.token_bytes,
        )

    def canonical(self) -> list[tuple[Namespace, bytes, tuple[Placement, ...]]]:
        """The directory's content independent of interning order, for tests and digests."""
        return self.capture().canonical()

    def digest(self) -> str:
        """blake3 hex digest of the canonical content (placements and access counts)."""
        return self.capture().digest()

    def snapshot(self) -> bytes:
        """Encode the directory; `restore` replays it through the same store path."""
        return self.capture().encode()

    def capture(self) -> DirectoryCapture:
        """The directory at this instant, for `DirectoryCapture.encode` to turn into
        snapshot bytes later: shallow copies of the maps, whose values are immutable.

        A shell that guards the directory with a lock holds it only for this copy, not
        for the encoding, which takes several times longer.
        """
        return DirectoryCapture(
            self._map.copy(),
            tuple(self._owners),
            tuple(self._namespaces),
            self._access.copy(),
            self._tokens.copy(),
        )
