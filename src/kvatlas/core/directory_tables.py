"""The key directory's tables: the memory layout of ``KeyDirectory`` and its interning.

Owns ``DirectoryTables``, the state every part of the directory reads and writes, and
the interning that keeps it small; ``KeyLog``, the reverse index of one L1 owner. Must
not: apply events, answer lookups or snapshot (``directory_reads`` answers,
``directory`` applies and restores), do any I/O.

Memory layout, designed for millions of keys (the directory holds hints; the owner
verifies the full key before any byte moves):

- A key is one Python int: ``ns_id << 64 | first 8 bytes of the chunk hash``. The
  namespace (model, kv rank, object group, salt) is interned to a small ``ns_id``.
- A placement is one int: ``owner_id << 40 | size_bytes``, where an owner (instance,
  incarnation, tier, backend, shared) is interned to ``owner_id``. Placement ints are
  interned too, so the millions of equal-sized chunks of one owner share one object.
- ``_map`` holds the placement int of a key with one placement, a tuple when several.
- The reverse index is an append-only log of keys per L1 owner (`KeyLog`), compacted
  when it holds twice as many keys as the owner really has; fencing walks only that
  log. It keeps its keys in tuples of up to `_LOG_BLOCK`: the garbage collector stops
  tracking a tuple of ints, while it visits every element of a list at every full
  collection (a list of a million keys made each one measurably longer).

A 64-bit prefix collision between two keys of one namespace merges their placements:
the answer is a hint, and the owner's full-key check turns it into a miss.

The directory is one class layered over three modules that share this state (the hot
paths read the tables as attributes of ``self``, with no indirection): the tables
here, the reads (``DirectoryReads``) over them, the writes (``KeyDirectory``) on top.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from operator import attrgetter

import numpy as np

from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import EventBatch, KeyBlock
from kvatlas.core.keys import HASH_BYTES, Namespace, ObjectKey, same_namespace
from kvatlas.core.placements import HASH_BITS, SIZE_BITS, SIZE_MASK, MapValue, Owner, Placement
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
    """The directory's state and its interning; the base of ``KeyDirectory``, which is
    the class to use. Single-threaded."""

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
        self._rev: dict[int, KeyLog] = {}
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
        (no live key int carries it): namespaces stored then deleted must not pile up."""
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
                self._rev[oid] = KeyLog()
        return oid

    def _drop_owner(self, oid: int) -> None:
        """Forget owner ``oid``, which holds no placement any more, and free its id for
        reuse: instances and incarnations come and go, and their owners must not pile up
        once all they stored is deleted."""
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
