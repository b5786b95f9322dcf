"""The key directory's writes: every change to the tables, through one way in.

Owns ``DirectoryWrites``: ``apply`` (STORE upserts, ACCESS counts, DELETE removes),
fencing a dead instance's L1 slice in time proportional to its own keys (the reverse
index), dropping an instance gone for good, and ``replay``, the stores of a decoded
snapshot put back through the same store path. Must not: answer lookups
(``directory_reads``), own or lay out the state (``directory_tables``), gate events,
know who is alive, or do any I/O.

It holds the one ``DirectoryTables`` the directory composes, and binds the tables its
per-key loops touch to its own slots once (the tables are never replaced), so the hot
paths pay no more than an attribute of ``self`` for each.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from operator import attrgetter

from kvatlas.core.coordinator.directory_snapshot import DirectorySnapshot
from kvatlas.core.coordinator.directory_tables import DirectoryTables, KeyLog
from kvatlas.core.coordinator.placements import (
    HASH_BITS,
    SIZE_BITS,
    SIZE_MASK,
    Applied,
    MapValue,
    Owner,
)
from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import EventBatch
from kvatlas.core.keys import MAX_TOKEN_ID
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier

_COMPACT_SLACK = 1024

_get_key = attrgetter("key")
_get_size = attrgetter("size_bytes")


def _check_sizes(sizes: Sequence[int]) -> bool:
    """Raise InvalidInput unless every size fits; True when all sizes are equal.

    Equal sizes are the common case (fixed-size chunks): one C-level count then checks
    the whole batch.
    """
    if not sizes:
        return True
    first = sizes[0]
    uniform = sizes.count(first) == len(sizes)
    lo, hi = (first, first) if uniform else (min(sizes), max(sizes))
    if lo < 0 or hi > SIZE_MASK:
        raise InvalidInput(f"size_bytes must be in [0, {SIZE_MASK}]")
    return uniform


class DirectoryWrites:
    """Every change to one ``DirectoryTables``; part of ``KeyDirectory``, which is the
    object to use. Single-threaded."""

    __slots__ = (
        "_access",
        "_codes",
        "_map",
        "_ns_keys",
        "_owner_bytes",
        "_owner_placements",
        "_rev",
        "_tables",
        "_tokens",
    )

    def __init__(self, tables: DirectoryTables) -> None:
        self._tables = tables
        # Direct references for the per-key loops (the tables are never replaced).
        self._map: dict[int, MapValue] = tables.map
        self._codes: dict[int, int] = tables.codes
        self._rev: dict[int, KeyLog] = tables.rev
        self._ns_keys: list[int] = tables.ns_keys
        self._owner_placements: list[int] = tables.owner_placements
        self._owner_bytes: list[int] = tables.owner_bytes
        self._access: dict[int, int] = tables.access
        self._tokens: dict[int, tuple[int, bytes]] = tables.tokens

    # ---- events ----------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> Applied:
        """Apply one admitted batch. STORE upserts, ACCESS counts, DELETE removes.

        A batch's objects are its entries followed by its block's. Validates every entry
        and the block before changing anything, so a bad batch applies nothing.
        """
        if batch.event_type is EventType.CONFIG:
            raise InvalidInput("a config batch declares capacity; it has no placements to apply")
        t = self._tables
        owner = Owner(batch.instance_id, batch.incarnation, batch.tier, batch.backend, batch.shared)
        entries = batch.entries
        block = batch.block
        n = len(entries) if block is None else len(entries) + block.count
        if block is not None:
            block.check_shape()
        if batch.event_type is EventType.STORE:
            keep_tokens = t.keep_tokens
            if keep_tokens:
                for e in entries:  # validate before anything changes
                    tk = e.token_ids
                    if tk and (min(tk) < 0 or max(tk) > MAX_TOKEN_ID):
                        raise InvalidInput("token ids must be in [0, 2**32-1]")
            sizes: Sequence[int]
            ns: int | None
            if block is None:
                sizes = list(map(_get_size, entries))
                uniform = _check_sizes(sizes)
                iks, ns = t.key_ints(list(map(_get_key, entries)))
            elif not entries:  # the fast form: columns straight from the wire
                sizes = block.sizes
                uniform = _check_sizes(sizes)
                iks = t.block_ints(block)
                ns = t.find_ns(block.namespace)
            else:
                sizes = list(map(_get_size, entries))
                sizes.extend(block.sizes)
                uniform = _check_sizes(sizes)
                iks, _ = t.key_ints(list(map(_get_key, entries)))
                iks.extend(t.block_ints(block))
                ns = None
            oid = t.owner_id(owner)
            created = self.store(oid, iks, sizes, uniform, ns)
            if not self._owner_placements[oid]:  # an empty batch: nothing holds the owner
                t.drop_owner(oid)
            if ns is not None and not self._ns_keys[ns]:  # interned for keys it had not
                t.drop_ns(ns)
            if keep_tokens:
                # iks holds the entries' keys first; a block carries no tokens.
                for key_int, e in zip(iks, entries, strict=False):
                    if e.token_ids is not None:
                        self._bind(key_int, e.token_offset, e.token_ids)
            return Applied(n, created=created)
        if batch.event_type is EventType.ACCESS:
            hit = 0
            m = self._map
            access = self._access
            for ik in t.find_ints(batch):
                if ik is not None and ik in m:
                    access[ik] = access.get(ik, 0) + 1
                    hit += 1
            return Applied(n, ignored=n - hit)
        found_oid = t.owner_ids.get(owner)
        if found_oid is None:
            return Applied(n, ignored=n)
        removed = 0
        remove = self._remove
        for ik in t.find_ints(batch):
            if ik is not None and remove(ik, found_oid):
                removed += 1
        return Applied(n, created=removed, ignored=n - removed)

    def store(
        self,
        oid: int,
        keys: Sequence[int],
        sizes: Sequence[int],
        uniform: bool | None = None,
        ns: int | None = None,
    ) -> int:
        """Upsert ``keys`` with ``sizes`` for owner ``oid``; returns placements created.

        ``uniform`` is `_check_sizes`' answer when the caller has already validated;
        ``ns`` the namespace of every key when the caller knows they share one.
        """
        m = self._map
        rev = self._rev.get(oid)
        codes = self._codes
        ns_keys = self._ns_keys
        # Validate before changing anything: a bad batch applies nothing.
        if uniform is None:
            uniform = _check_sizes(sizes)
        n = len(keys)
        base = oid << SIZE_BITS
        if uniform and n:
            code = base | sizes[0]
            new = dict.fromkeys(keys, codes.setdefault(code, code))
        else:
            new = dict(
                zip(keys, [codes.setdefault(base | s, base | s) for s in sizes], strict=True)
            )
        if len(new) == n and m.keys().isdisjoint(new.keys()):
            # Fast path, the common case: every key is new and none repeats. All loops
            # run in C.
            m.update(new)
            if ns is not None:
                ns_keys[ns] += n
            else:
                for ik in keys:
                    ns_keys[ik >> HASH_BITS] += 1
            if rev is not None:
                rev.extend(keys)
            self._owner_placements[oid] += n
            self._owner_bytes[oid] += sizes[0] * n if uniform and n else sum(sizes)
            return n
        created = 0
        added_bytes = 0
        for ik, size in zip(keys, sizes, strict=True):
            code = oid << SIZE_BITS | size
            code = codes.setdefault(code, code)
            cur = m.get(ik)
            if cur is None:
                m[ik] = code
                ns_keys[ik >> HASH_BITS] += 1
            elif type(cur) is int:
                if cur >> SIZE_BITS == oid:
                    m[ik] = code
                    added_bytes += size - (cur & SIZE_MASK)
                    continue
                m[ik] = (cur, code)
            else:
                assert isinstance(cur, tuple)
                for i, c in enumerate(cur):
                    if c >> SIZE_BITS == oid:
                        m[ik] = (*cur[:i], code, *cur[i + 1 :])
                        added_bytes += size - (c & SIZE_MASK)
                        break
                else:
                    m[ik] = (*cur, code)
                    created += 1
                    added_bytes += size
                    if rev is not None:
                        rev.append(ik)
                continue
            created += 1
            added_bytes += size
            if rev is not None:
                rev.append(ik)
        self._owner_placements[oid] += created
        self._owner_bytes[oid] += added_bytes
        return created

    def _remove(self, ik: int, oid: int, compact: bool = True) -> bool:
        m = self._map
        cur = m.get(ik)
        if cur is None:
            return False
        if type(cur) is int:
            if cur >> SIZE_BITS != oid:
                return False
            del m[ik]
            nsi = ik >> HASH_BITS
            ns_keys = self._ns_keys
            ns_keys[nsi] -= 1
            if not ns_keys[nsi]:
                self._tables.drop_ns(nsi)
            self._access.pop(ik, None)
            if self._tokens:
                old = self._tokens.pop(ik, None)
                if old is not None:
                    self._tables.token_bytes -= len(old[1])
            removed = cur
        else:
            assert isinstance(cur, tuple)
            keep = tuple(c for c in cur if c >> SIZE_BITS != oid)
            if len(keep) == len(cur):
                return False
            removed = next(c for c in cur if c >> SIZE_BITS == oid)
            m[ik] = keep[0] if len(keep) == 1 else keep
        placements = self._owner_placements
        placements[oid] -= 1
        self._owner_bytes[oid] -= removed & SIZE_MASK
        if not placements[oid]:
            self._tables.drop_owner(oid)
        elif compact:
            self._maybe_compact(oid)
        return True

    def _maybe_compact(self, oid: int) -> None:
        rev = self._rev.get(oid)
        if rev is None or len(rev) <= 2 * self._owner_placements[oid] + _COMPACT_SLACK:
            return
        self._rev[oid] = KeyLog(ik for ik in dict.fromkeys(rev) if self._holds(ik, oid))

    def _holds(self, ik: int, oid: int) -> bool:
        cur = self._map.get(ik)
        if cur is None:
            return False
        if type(cur) is int:
            return cur >> SIZE_BITS == oid
        assert isinstance(cur, tuple)
        return any(c >> SIZE_BITS == oid for c in cur)

    def _bind(self, ik: int, offset: int, tokens: Sequence[int]) -> None:
        raw = array.array("I", tokens).tobytes()
        old = self._tokens.get(ik)
        self._tokens[ik] = (offset, raw)
        self._tables.token_bytes += len(raw) - (len(old[1]) if old is not None else 0)

    # ---- fencing ---------------------------------------------------------------------

    def fence(self, instance_id: InstanceId, incarnation: Incarnation | None = None) -> int:
        """Remove the L1 placements of ``instance_id`` (of one incarnation, or of all).

        Costs time proportional to that instance's L1 keys. L2 placements stay: they
        outlive the process and leave only through their own DELETE events.
        Returns the number of placements removed.
        """
        t = self._tables
        removed = 0
        remove = self._remove
        for oid in sorted(t.owners_by_instance.get(instance_id, ())):
            owner = t.owners[oid]
            if owner.tier is not Tier.L1:
                continue
            if incarnation is not None and owner.incarnation != incarnation:
                continue
            rev = self._rev.get(oid, KeyLog())
            self._rev[oid] = KeyLog()
            for ik in rev:
                if remove(ik, oid, compact=False):
                    removed += 1
        return removed

    def drop(self, instance_id: InstanceId) -> int:
        """Remove every placement of ``instance_id``: every tier, every incarnation.

        L1 goes through the reverse index; the other tiers have none (their placements
        are many and long-lived, and an index would cost 8 bytes each), so one pass over
        the map finds them: time proportional to the whole directory, paid once per
        instance that is gone for good (``FleetState``'s L2 retention). Returns the
        number of placements removed.
        """
        removed = self.fence(instance_id)
        targets = frozenset(self._tables.owners_by_instance.get(instance_id, ()))
        if not targets:
            return removed
        found: list[tuple[int, int]] = []
        for ik, cur in self._map.items():
            if type(cur) is int:
                if cur >> SIZE_BITS in targets:
                    found.append((ik, cur >> SIZE_BITS))
            else:
                assert isinstance(cur, tuple)
                found.extend((ik, c >> SIZE_BITS) for c in cur if c >> SIZE_BITS in targets)
        for ik, oid in found:
            if self._remove(ik, oid, compact=False):
                removed += 1
        return removed

    def fence_below(self, instance_id: InstanceId, incarnation: Incarnation) -> int:
        """Fence every L1 incarnation of ``instance_id`` lower than ``incarnation``."""
        owners = self._tables.owners
        removed = 0
        for inc in sorted(
            {
                owners[o].incarnation
                for o in self._tables.owners_by_instance.get(instance_id, ())
                if owners[o].incarnation < incarnation
            }
        ):
            removed += self.fence(instance_id, inc)
        return removed

    # ---- restore ---------------------------------------------------------------------

    def replay(self, snap: DirectorySnapshot) -> None:
        """Put a decoded snapshot's stores, access counts and (when the tables keep
        them) token bindings into these tables, which must be empty: a restore is a
        replay through the same store path."""
        t = self._tables
        if t.map:
            raise InvalidInput("a snapshot replays into an empty directory only")
        remap: dict[int, int] = {}  # only namespaces that hold keys (a freed slot holds none)

        def key(ns: int, prefix: int) -> int | None:
            new = remap.get(ns)
            return None if new is None else new << HASH_BITS | prefix

        for so in snap.owners:
            ns = remap.get(so.namespace)
            if ns is None:
                ns = remap[so.namespace] = t.ns_id(snap.namespaces[so.namespace])
            base = ns << HASH_BITS
            self.store(t.owner_id(so.owner), [base | k for k in so.keys], so.sizes, ns=ns)
        m = self._map
        for nsi, prefix, n in snap.access:
            if (ik := key(nsi, prefix)) is not None and ik in m:
                self._access[ik] = n
        if t.keep_tokens:
            for nsi, prefix, off, toks in snap.tokens:
                if (ik := key(nsi, prefix)) is not None and ik in m:
                    self._tokens[ik] = (off, toks)
                    t.token_bytes += len(toks)
