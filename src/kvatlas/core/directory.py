"""The key directory: which chunk of KV lives where, as hints for millions of keys.

Owns the map object key -> placements (instance, incarnation, tier, backend, size,
shared), the reverse index that lets a dead instance's L1 slice be fenced in time
proportional to its own keys, access counts, optional chunk <-> token bindings, stats,
snapshot and restore. It does not gate events (see `gate`), know who is alive (see
`membership`) or do any I/O.

Memory layout, designed for millions of keys (the directory holds hints; the owner
verifies the full key before any byte moves):

- A key is one Python int: ``ns_id << 64 | first 8 bytes of the chunk hash``. The
  namespace (model, kv rank, object group, salt) is interned to a small ``ns_id``.
- A placement is one int: ``owner_id << 40 | size_bytes``, where an owner (instance,
  incarnation, tier, backend, shared) is interned to ``owner_id``. Placement ints are
  interned too, so the millions of equal-sized chunks of one owner share one object.
- ``_map`` holds the placement int of a key with one placement, a tuple when several.
- The reverse index is an append-only log of keys per L1 owner (`_KeyLog`), compacted
  when it holds twice as many keys as the owner really has; fencing walks only that
  log. It keeps its keys in tuples of up to `_LOG_BLOCK`: the garbage collector stops
  tracking a tuple of ints, while it visits every element of a list at every full
  collection (a list of a million keys made each one ~10 ms longer).

A 64-bit prefix collision between two keys of one namespace merges their placements:
the answer is a hint, and the owner's full-key check turns it into a miss.

The result types and the int layout live in ``placements``; the snapshot format and the
capture a shell encodes outside its lock live in ``directory_snapshot``.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice
from operator import attrgetter

import numpy as np

from kvatlas.core.directory_snapshot import DirectoryCapture, decode_snapshot
from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import EventBatch, KeyBlock
from kvatlas.core.keys import HASH_BYTES, MAX_TOKEN_ID, Namespace, ObjectKey, same_namespace
from kvatlas.core.placements import (
    HASH_BITS,
    HASH_MASK,
    SIZE_BITS,
    SIZE_MASK,
    Applied,
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
from kvatlas.core.types import ChunkHash, EventType, Incarnation, InstanceId, Tier

_COMPACT_SLACK = 1024
_FREED_NS = Namespace("", -1, -1, "")
"""What a dropped namespace's slot holds until its id is reused (no key int names it)."""
_FREED = Owner(InstanceId(""), Incarnation(-1), Tier.L1, "", False)
"""What a dropped owner's slot holds until its id is reused (no map value names it)."""
_CACHE_LIMIT = 65536
_LOG_BLOCK = 4096
"""Keys a `_KeyLog` gathers in a list before it moves them into a tuple."""

_get_key = attrgetter("key")
_get_size = attrgetter("size_bytes")
_get_hash = attrgetter("chunk_hash")


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


class _KeyLog:
    """The keys stored for one L1 owner, in order, repeats and stale ones included."""

    __slots__ = ("_blocks", "_size", "_tail")

    def __init__(self, keys: Iterable[int] = ()) -> None:
        self._blocks: list[tuple[int, ...]] = []
        self._tail: list[int] = []
        self._size = 0
        self.extend(keys)

    def extend(self, keys: Iterable[int]) -> None:
        tail = self._tail
        before = len(tail)
        tail.extend(keys)
        self._size += len(tail) - before
        if len(tail) >= _LOG_BLOCK:
            self._blocks.append(tuple(tail))
            self._tail = []

    def append(self, key: int) -> None:
        self._tail.append(key)
        self._size += 1
        if len(self._tail) >= _LOG_BLOCK:
            self._blocks.append(tuple(self._tail))
            self._tail = []

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[int]:
        return chain(chain.from_iterable(self._blocks), self._tail)


class KeyDirectory:
    """Object key -> placements, with a reverse index per L1 owner. Single-threaded."""

    def __init__(self, keep_tokens: bool = False) -> None:
        """``keep_tokens``: bind the token ids that STORE entries carry to their keys
        (lookups answer them); the memory is spent only on entries that carry tokens."""
        self.keep_tokens = keep_tokens
        self._ns_ids: dict[tuple[str, int, int, str], int] = {}
        self._namespaces: list[Namespace] = []
        self._ns_keys: list[int] = []
        """Keys of each namespace in the map; a namespace left with none is dropped."""
        self._free_ns: list[int] = []
        self._owner_ids: dict[Owner, int] = {}
        self._owners: list[Owner] = []
        self._owners_by_instance: dict[InstanceId, set[int]] = {}
        self._free_oids: list[int] = []
        """Owner ids whose owner holds nothing any more, to reuse (`_drop_owner`)."""
        self._codes: dict[int, int] = {}
        self._map: dict[int, MapValue] = {}
        self._rev: dict[int, _KeyLog] = {}
        self._count: list[int] = []
        self._bytes: list[int] = []
        self._access: dict[int, int] = {}
        self._tokens: dict[int, tuple[int, bytes]] = {}
        self._token_bytes = 0
        """Bytes of the kept token arrays (4 per token), for stats."""
        self._pl_cache: dict[MapValue | None, tuple[Placement, ...]] = {None: ()}

    # ---- interning -------------------------------------------------------------------

    def _ns_id(self, key: ObjectKey | Namespace) -> int:
        t = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        ns = self._ns_ids.get(t)
        if ns is None:
            if self._free_ns:
                ns = self._free_ns.pop()
                self._namespaces[ns] = Namespace(*t)
            else:
                ns = len(self._namespaces)
                self._namespaces.append(Namespace(*t))
                self._ns_keys.append(0)
            self._ns_ids[t] = ns
        return ns

    def _drop_ns(self, ns: int) -> None:
        """Forget namespace ``ns``, which has no key in the map any more, and free its id
        (no live key int carries it): namespaces stored then deleted (20k of them used
        to keep ~4 MB) must not pile up."""
        n = self._namespaces[ns]
        del self._ns_ids[(n.model_name, n.kv_rank, n.object_group_id, n.cache_salt)]
        self._namespaces[ns] = _FREED_NS
        self._free_ns.append(ns)

    def _find_ns(self, ns: Namespace) -> int | None:
        return self._ns_ids.get((ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt))

    def _key_int(self, key: ObjectKey) -> int:
        if len(key.chunk_hash) < 8:
            raise InvalidInput("chunk hash must have at least 8 bytes")
        return self._ns_id(key) << HASH_BITS | int.from_bytes(key.chunk_hash[:8], "big")

    def _key_ints(self, keys: Sequence[ObjectKey]) -> tuple[list[int], int | None]:
        """Key ints of many keys, and their namespace when they share one (C-speed
        when they do and have full hashes); None when they do not (or there are none)."""
        if not keys:
            return [], None
        blob = b"".join(map(_get_hash, keys))
        if len(blob) != HASH_BYTES * len(keys) or not same_namespace(keys):
            return [self._key_int(k) for k in keys], None
        ns = self._ns_id(keys[0])
        return self._blob_ints(ns, blob), ns

    @staticmethod
    def _blob_ints(ns_id: int, blob: bytes) -> list[int]:
        """Key ints of a blob of full hashes of namespace ``ns_id``."""
        prefixes: list[int] = np.frombuffer(blob, dtype=">u8")[:: HASH_BYTES // 8].tolist()
        if ns_id == 0:
            return prefixes
        base = ns_id << HASH_BITS
        return [base | h for h in prefixes]

    def _block_ints(self, block: KeyBlock) -> list[int]:
        """Key ints of a (shape-checked) block; interns its namespace."""
        return self._blob_ints(self._ns_id(block.namespace), block.hashes)

    def _find_ints(self, batch: EventBatch) -> list[int | None]:
        """Key ints of every object of a batch without interning (None: never seen)."""
        out: list[int | None] = [self._find_key(e.key) for e in batch.entries]
        block = batch.block
        if block is not None:
            ns_id = self._find_ns(block.namespace)
            if ns_id is None:
                out.extend([None] * block.count)
            else:
                out.extend(self._blob_ints(ns_id, block.hashes))
        return out

    def _find_key(self, key: ObjectKey) -> int | None:
        ns = self._ns_ids.get((key.model_name, key.kv_rank, key.object_group_id, key.cache_salt))
        if ns is None or len(key.chunk_hash) < 8:
            return None
        return ns << HASH_BITS | int.from_bytes(key.chunk_hash[:8], "big")

    def _owner_id(self, owner: Owner) -> int:
        oid = self._owner_ids.get(owner)
        if oid is None:
            if self._free_oids:
                oid = self._free_oids.pop()
                self._owners[oid] = owner
            else:
                oid = len(self._owners)
                self._owners.append(owner)
                self._count.append(0)
                self._bytes.append(0)
            self._owner_ids[owner] = oid
            self._owners_by_instance.setdefault(owner.instance_id, set()).add(oid)
            if owner.tier is Tier.L1:
                self._rev[oid] = _KeyLog()
        return oid

    def _drop_owner(self, oid: int) -> None:
        """Forget owner ``oid``, which holds no placement any more, and free its id for
        reuse: instances and incarnations come and go, and their owners must not pile up
        (stored then deleted, 20k of them used to keep ~8 MB)."""
        owner = self._owners[oid]
        del self._owner_ids[owner]
        ids = self._owners_by_instance[owner.instance_id]
        ids.discard(oid)
        if not ids:
            del self._owners_by_instance[owner.instance_id]
        self._rev.pop(oid, None)
        self._codes = {c: c for c in self._codes if c >> SIZE_BITS != oid}
        # Cached placements decode codes by owner id, which the next owner reuses.
        self._pl_cache = {None: ()}
        self._owners[oid] = _FREED
        self._count[oid] = self._bytes[oid] = 0
        self._free_oids.append(oid)

    def _code(self, oid: int, size: int) -> int:
        if not 0 <= size <= SIZE_MASK:
            raise InvalidInput(f"size_bytes must be in [0, {SIZE_MASK}], got {size}")
        code = oid << SIZE_BITS | size
        return self._codes.setdefault(code, code)

    # ---- events ----------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> Applied:
        """Apply one admitted batch. STORE upserts, ACCESS counts, DELETE removes.

        A batch's objects are its entries followed by its block's. Validates every entry
        and the block before changing anything, so a bad batch applies nothing.
        """
        if batch.event_type is EventType.CONFIG:
            raise InvalidInput("a config batch declares capacity; it has no placements to apply")
        owner = Owner(batch.instance_id, batch.incarnation, batch.tier, batch.backend, batch.shared)
        entries = batch.entries
        block = batch.block
        n = len(entries) if block is None else len(entries) + block.count
        if block is not None:
            block.check_shape()
        if batch.event_type is EventType.STORE:
            if self.keep_tokens:
                for e in entries:  # validate before anything changes
                    t = e.token_ids
                    if t and (min(t) < 0 or max(t) > MAX_TOKEN_ID):
                        raise InvalidInput("token ids must be in [0, 2**32-1]")
            sizes: Sequence[int]
            ns: int | None
            if block is None:
                sizes = list(map(_get_size, entries))
                uniform = _check_sizes(sizes)
                iks, ns = self._key_ints(list(map(_get_key, entries)))
            elif not entries:  # the fast form: columns straight from the wire
                sizes = block.sizes
                uniform = _check_sizes(sizes)
                iks = self._block_ints(block)
                ns = self._find_ns(block.namespace)
            else:
                sizes = list(map(_get_size, entries))
                sizes.extend(block.sizes)
                uniform = _check_sizes(sizes)
                iks, _ = self._key_ints(list(map(_get_key, entries)))
                iks.extend(self._block_ints(block))
                ns = None
            oid = self._owner_id(owner)
            created = self._store(oid, iks, sizes, uniform, ns)
            if not self._count[oid]:  # an empty batch: nothing holds the new owner
                self._drop_owner(oid)
            if ns is not None and not self._ns_keys[ns]:  # interned for keys it had not
                self._drop_ns(ns)
            if self.keep_tokens:
                # iks holds the entries' keys first; a block carries no tokens.
                for key_int, e in zip(iks, entries, strict=False):
                    if e.token_ids is not None:
                        self._bind(key_int, e.token_offset, e.token_ids)
            return Applied(n, created=created)
        found_oid = self._owner_ids.get(owner)
        if batch.event_type is EventType.ACCESS:
            hit = 0
            m = self._map
            for ik in self._find_ints(batch):
                if ik is not None and ik in m:
                    self._access[ik] = self._access.get(ik, 0) + 1
                    hit += 1
            return Applied(n, ignored=n - hit)
        if found_oid is None:
            return Applied(n, ignored=n)
        removed = 0
        for ik in self._find_ints(batch):
            if ik is not None and self._remove(ik, found_oid):
                removed += 1
        return Applied(n, created=removed, ignored=n - removed)

    def _store(
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
                self._ns_keys[ns] += n
            else:
                for ik in keys:
                    self._ns_keys[ik >> HASH_BITS] += 1
            if rev is not None:
                rev.extend(keys)
            self._count[oid] += n
            self._bytes[oid] += sizes[0] * n if uniform and n else sum(sizes)
            return n
        created = 0
        added_bytes = 0
        for ik, size in zip(keys, sizes, strict=True):
            code = oid << SIZE_BITS | size
            code = codes.setdefault(code, code)
            cur = m.get(ik)
            if cur is None:
                m[ik] = code
                self._ns_keys[ik >> HASH_BITS] += 1
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
        self._count[oid] += created
        self._bytes[oid] += added_bytes
        return created

    def _remove(self, ik: int, oid: int, compact: bool = True) -> bool:
        cur = self._map.get(ik)
        if cur is None:
            return False
        if type(cur) is int:
            if cur >> SIZE_BITS != oid:
                return False
            del self._map[ik]
            nsi = ik >> HASH_BITS
            self._ns_keys[nsi] -= 1
            if not self._ns_keys[nsi]:
                self._drop_ns(nsi)
            self._access.pop(ik, None)
            if self._tokens:
                old = self._tokens.pop(ik, None)
                if old is not None:
                    self._token_bytes -= len(old[1])
            removed = cur
        else:
            assert isinstance(cur, tuple)
            keep = tuple(c for c in cur if c >> SIZE_BITS != oid)
            if len(keep) == len(cur):
                return False
            removed = next(c for c in cur if c >> SIZE_BITS == oid)
            self._map[ik] = keep[0] if len(keep) == 1 else keep
        self._count[oid] -= 1
        self._bytes[oid] -= removed & SIZE_MASK
        if not self._count[oid]:
            self._drop_owner(oid)
        elif compact:
            self._maybe_compact(oid)
        return True

    def _maybe_compact(self, oid: int) -> None:
        rev = self._rev.get(oid)
        if rev is None or len(rev) <= 2 * self._count[oid] + _COMPACT_SLACK:
            return
        self._rev[oid] = _KeyLog(ik for ik in dict.fromkeys(rev) if self._holds(ik, oid))

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
        self._token_bytes += len(raw) - (len(old[1]) if old is not None else 0)

    # ---- fencing ---------------------------------------------------------------------

    def fence(self, instance_id: InstanceId, incarnation: Incarnation | None = None) -> int:
        """Remove the L1 placements of ``instance_id`` (of one incarnation, or of all).

        Costs time proportional to that instance's L1 keys. L2 placements stay: they
        outlive the process and leave only through their own DELETE events.
        Returns the number of placements removed.
        """
        removed = 0
        for oid in sorted(self._owners_by_instance.get(instance_id, ())):
            owner = self._owners[oid]
            if owner.tier is not Tier.L1:
                continue
            if incarnation is not None and owner.incarnation != incarnation:
                continue
            rev = self._rev.get(oid, _KeyLog())
            self._rev[oid] = _KeyLog()
            for ik in rev:
                if self._remove(ik, oid, compact=False):
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
        targets = frozenset(self._owners_by_instance.get(instance_id, ()))
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
        removed = 0
        for inc in sorted(
            {
                self._owners[o].incarnation
                for o in self._owners_by_instance.get(instance_id, ())
                if self._owners[o].incarnation < incarnation
            }
        ):
            removed += self.fence(instance_id, inc)
        return removed

    # ---- lookups ---------------------------------------------------------------------

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
            return [self._result(k, self._find_key(k)) for k in keys]
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
        ns_id = self._find_ns(ns)
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
        ns_id = self._find_ns(ns)
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
        for oid, o in enumerate(self._owners):
            n, b = self._count[oid], self._bytes[oid]
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
            token_bytes=self._token_bytes,
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

        A shell that guards the directory with a lock holds it only for this (~35 ms
        at 1M keys here), not for the encoding (~250 ms).
        """
        return DirectoryCapture(
            self._map.copy(),
            tuple(self._owners),
            tuple(self._namespaces),
            self._access.copy(),
            self._tokens.copy(),
        )

    @classmethod
    def restore(cls, data: bytes, keep_tokens: bool = False) -> KeyDirectory:
        """Rebuild a directory from `snapshot` bytes by replaying its stores."""
        snap = decode_snapshot(data)
        d = cls(keep_tokens=keep_tokens)
        remap: dict[int, int] = {}  # only namespaces that hold keys (a freed slot holds none)

        def key(ns: int, prefix: int) -> int | None:
            new = remap.get(ns)
            return None if new is None else new << HASH_BITS | prefix

        for so in snap.owners:
            ns = remap.get(so.namespace)
            if ns is None:
                ns = remap[so.namespace] = d._ns_id(snap.namespaces[so.namespace])
            base = ns << HASH_BITS
            d._store(d._owner_id(so.owner), [base | k for k in so.keys], so.sizes, ns=ns)
        for nsi, prefix, n in snap.access:
            if (ik := key(nsi, prefix)) is not None and ik in d._map:
                d._access[ik] = n
        if keep_tokens:
            for nsi, prefix, off, toks in snap.tokens:
                if (ik := key(nsi, prefix)) is not None and ik in d._map:
                    d._tokens[ik] = (off, toks)
                    d._token_bytes += len(toks)
        return d
