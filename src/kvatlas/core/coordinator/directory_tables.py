"""The key directory's tables: the state ``KeyDirectory`` composes, and its interning.

Owns ``DirectoryTables``, the one state the directory's reads and writes share (its
tables are public attributes, created once and never replaced, so each part may hold a
direct reference to them), and the interning that keeps it small; ``KeyLog``, the
reverse index of one L1 owner. Must not: apply events, answer lookups or snapshot
(``directory_writes`` applies and replays, ``directory_reads`` answers), do any I/O.

Memory layout, designed for millions of keys (the directory holds hints; the owner
verifies the full key before any byte moves):

- A key is one Python int: ``ns_id << 64 | first 8 bytes of the chunk hash``. The
  namespace (model, kv rank, object group, salt) is interned to a small ``ns_id``.
- A placement is one int: ``owner_id << 40 | size_bytes``, where an owner (instance,
  incarnation, tier, backend, shared) is interned to ``owner_id``. Placement ints are
  interned too, so the millions of equal-sized chunks of one owner share one object.
- ``map`` holds the placement int of a key with one placement, a tuple when several.
- The reverse index is an append-only log of keys per L1 owner (`KeyLog`), compacted
  when it holds twice as many keys as the owner really has; fencing walks only that
  log. It keeps its keys in tuples of up to `_LOG_BLOCK`: the garbage collector stops
  tracking a tuple of ints, while it visits every element of a list at every full
  collection (a list of a million keys made each one measurably longer).

A 64-bit prefix collision between two keys of one namespace merges their placements:
the answer is a hint, and the owner's full-key check turns it into a miss.

The directory composes three objects over one instance of these tables, as vLLM's KV
cache coordinator composes one block pool and the managers that share it: the tables
here, the reads (``DirectoryReads``) and the writes (``DirectoryWrites``). The hot paths
of the reads and writes bind the tables they use once, at construction, so a lookup or
an apply reads them with no more indirection than an attribute of its own object.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from operator import attrgetter

import numpy as np

from kvatlas.core.coordinator.placements import HASH_BITS, SIZE_BITS, MapValue, Owner, Placement
from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import EventBatch, KeyBlock
from kvatlas.core.keys import HASH_BYTES, Namespace, ObjectKey, same_namespace
from kvatlas.core.types import Incarnation, InstanceId, Tier

_FREED_NS = Namespace("", -1, -1, "")
"""What a dropped namespace's slot holds until its id is reused (no key int names it)."""
_FREED = Owner(InstanceId(""), Incarnation(-1), Tier.L1, "", False)
"""What a dropped owner's slot holds until its id is reused (no map value names it)."""
_LOG_BLOCK = 4096
"""Keys a `KeyLog` gathers in a list before it moves them into a tuple."""

_get_hash = attrgetter("chunk_hash")


class KeyLog:
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


class DirectoryTables:
    """The directory's state and its interning, shared by one ``DirectoryReads`` and one
    ``DirectoryWrites`` (``KeyDirectory`` builds the three). Single-threaded.

    Every table below is created here and never replaced, only changed in place: the
    reads and writes hold references to them. ``token_bytes`` is the one plain number;
    read and write it through the tables.
    """

    __slots__ = (
        "access",
        "codes",
        "free_ns",
        "free_oids",
        "keep_tokens",
        "map",
        "namespaces",
        "ns_ids",
        "ns_keys",
        "owner_bytes",
        "owner_ids",
        "owner_placements",
        "owners",
        "owners_by_instance",
        "pl_cache",
        "rev",
        "token_bytes",
        "tokens",
    )

    def __init__(self, keep_tokens: bool = False) -> None:
        """``keep_tokens``: bind the token ids that STORE entries carry to their keys
        (lookups answer them); the memory is spent only on entries that carry tokens."""
        self.keep_tokens = keep_tokens
        self.ns_ids: dict[tuple[str, int, int, str], int] = {}
        """Interned namespace (as a tuple) -> ``ns_id``."""
        self.namespaces: list[Namespace] = []
        """``ns_id`` -> namespace (``_FREED_NS`` in a freed slot)."""
        self.ns_keys: list[int] = []
        """Keys of each namespace in the map; a namespace left with none is dropped."""
        self.free_ns: list[int] = []
        self.owner_ids: dict[Owner, int] = {}
        self.owners: list[Owner] = []
        """``owner_id`` -> owner (``_FREED`` in a freed slot)."""
        self.owners_by_instance: dict[InstanceId, set[int]] = {}
        self.free_oids: list[int] = []
        """Owner ids whose owner holds nothing any more, to reuse (`drop_owner`)."""
        self.codes: dict[int, int] = {}
        """Interned placement ints: equal placements share one object."""
        self.map: dict[int, MapValue] = {}
        """Key int -> its placement int, or a tuple of them."""
        self.rev: dict[int, KeyLog] = {}
        """L1 ``owner_id`` -> the keys it stored (the reverse index fencing walks)."""
        self.owner_placements: list[int] = []
        """Placements each owner holds; an owner left with none is dropped."""
        self.owner_bytes: list[int] = []
        self.access: dict[int, int] = {}
        self.tokens: dict[int, tuple[int, bytes]] = {}
        """Key int -> (token offset, uint32 token ids) when ``keep_tokens``."""
        self.token_bytes = 0
        """Bytes of the kept token arrays (4 per token), for stats."""
        self.pl_cache: dict[MapValue | None, tuple[Placement, ...]] = {None: ()}
        """Decoded placement sets, filled by the reads, emptied when an owner id is freed."""

    # ---- interning -------------------------------------------------------------------

    def ns_id(self, key: ObjectKey | Namespace) -> int:
        """The id of ``key``'s namespace, interned if new."""
        t = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        ns = self.ns_ids.get(t)
        if ns is None:
            if self.free_ns:
                ns = self.free_ns.pop()
                self.namespaces[ns] = Namespace(*t)
            else:
                ns = len(self.namespaces)
                self.namespaces.append(Namespace(*t))
                self.ns_keys.append(0)
            self.ns_ids[t] = ns
        return ns

    def drop_ns(self, ns: int) -> None:
        """Forget namespace ``ns``, which has no key in the map any more, and free its id
        (no live key int carries it): namespaces stored then deleted must not pile up."""
        n = self.namespaces[ns]
        del self.ns_ids[(n.model_name, n.kv_rank, n.object_group_id, n.cache_salt)]
        self.namespaces[ns] = _FREED_NS
        self.free_ns.append(ns)

    def find_ns(self, ns: Namespace) -> int | None:
        """The id of ``ns`` without interning (None: it holds no key)."""
        return self.ns_ids.get((ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt))

    def key_int(self, key: ObjectKey) -> int:
        """The key int of ``key``; interns its namespace."""
        if len(key.chunk_hash) < 8:
            raise InvalidInput("chunk hash must have at least 8 bytes")
        return self.ns_id(key) << HASH_BITS | int.from_bytes(key.chunk_hash[:8], "big")

    def key_ints(self, keys: Sequence[ObjectKey]) -> tuple[list[int], int | None]:
        """Key ints of many keys, and their namespace when they share one (C-speed
        when they do and have full hashes); None when they do not (or there are none)."""
        if not keys:
            return [], None
        blob = b"".join(map(_get_hash, keys))
        if len(blob) != HASH_BYTES * len(keys) or not same_namespace(keys):
            return [self.key_int(k) for k in keys], None
        ns = self.ns_id(keys[0])
        return self.blob_ints(ns, blob), ns

    @staticmethod
    def blob_ints(ns_id: int, blob: bytes) -> list[int]:
        """Key ints of a blob of full hashes of namespace ``ns_id``."""
        prefixes: list[int] = np.frombuffer(blob, dtype=">u8")[:: HASH_BYTES // 8].tolist()
        if ns_id == 0:
            return prefixes
        base = ns_id << HASH_BITS
        return [base | h for h in prefixes]

    def block_ints(self, block: KeyBlock) -> list[int]:
        """Key ints of a (shape-checked) block; interns its namespace."""
        return self.blob_ints(self.ns_id(block.namespace), block.hashes)

    def find_ints(self, batch: EventBatch) -> list[int | None]:
        """Key ints of every object of a batch without interning (None: never seen)."""
        out: list[int | None] = [self.find_key(e.key) for e in batch.entries]
        block = batch.block
        if block is not None:
            ns_id = self.find_ns(block.namespace)
            if ns_id is None:
                out.extend([None] * block.count)
            else:
                out.extend(self.blob_ints(ns_id, block.hashes))
        return out

    def find_key(self, key: ObjectKey) -> int | None:
        """The key int of ``key`` without interning (None: its namespace holds no key)."""
        ns = self.ns_ids.get((key.model_name, key.kv_rank, key.object_group_id, key.cache_salt))
        if ns is None or len(key.chunk_hash) < 8:
            return None
        return ns << HASH_BITS | int.from_bytes(key.chunk_hash[:8], "big")

    def owner_id(self, owner: Owner) -> int:
        """The id of ``owner``, interned if new (an L1 owner gets an empty reverse index)."""
        oid = self.owner_ids.get(owner)
        if oid is None:
            if self.free_oids:
                oid = self.free_oids.pop()
                self.owners[oid] = owner
            else:
                oid = len(self.owners)
                self.owners.append(owner)
                self.owner_placements.append(0)
                self.owner_bytes.append(0)
            self.owner_ids[owner] = oid
            self.owners_by_instance.setdefault(owner.instance_id, set()).add(oid)
            if owner.tier is Tier.L1:
                self.rev[oid] = KeyLog()
        return oid

    def drop_owner(self, oid: int) -> None:
        """Forget owner ``oid``, which holds no placement any more, and free its id for
        reuse: instances and incarnations come and go, and their owners must not pile up
        once all they stored is deleted."""
        owner = self.owners[oid]
        del self.owner_ids[owner]
        ids = self.owners_by_instance[owner.instance_id]
        ids.discard(oid)
        if not ids:
            del self.owners_by_instance[owner.instance_id]
        self.rev.pop(oid, None)
        codes = self.codes
        for c in [c for c in codes if c >> SIZE_BITS == oid]:
            del codes[c]
        # Cached placements decode codes by owner id, which the next owner reuses.
        self.pl_cache.clear()
        self.pl_cache[None] = ()
        self.owners[oid] = _FREED
        self.owner_placements[oid] = self.owner_bytes[oid] = 0
        self.free_oids.append(oid)
