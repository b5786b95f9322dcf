"""The key directory: which chunk of KV lives where, as hints for millions of keys.

Owns ``KeyDirectory``, the map object key -> placements (instance, incarnation, tier,
backend, size, shared) that the coordinator keeps: the object every caller holds, and
the one that builds its parts. It does not gate events (see `gate`), know who is alive
(see `membership`) or do any I/O.

The directory composes three objects, as vLLM's KV cache coordinator composes one
block pool and the managers that share it, with no inheritance between them:

- ``tables`` (``DirectoryTables``, ``directory_tables``): the one state, its memory
  layout and interning, described there;
- ``reads`` (``DirectoryReads``, ``directory_reads``): lookups, listing, stats and the
  snapshot capture;
- ``writes`` (``DirectoryWrites``, ``directory_writes``): the one way in, ``apply``
  (STORE upserts, ACCESS counts, DELETE removes), fencing a dead instance's L1 slice in
  time proportional to its own keys, dropping an instance gone for good, and the replay
  ``restore`` runs.

Reads and writes share the one tables instance and hold direct references to its tables
for their hot paths. The methods here only forward, so that callers keep one object and
one API. The result types and the int layout live in ``placements``; the snapshot format
in ``directory_snapshot``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvatlas.core.coordinator.directory_reads import DirectoryReads
from kvatlas.core.coordinator.directory_snapshot import DirectoryCapture, decode_snapshot
from kvatlas.core.coordinator.directory_tables import DirectoryTables
from kvatlas.core.coordinator.directory_writes import DirectoryWrites
from kvatlas.core.coordinator.placements import (
    Applied,
    DirectoryStats,
    KeyColumns,
    KeyResult,
    Placement,
    PrefixResult,
)
from kvatlas.core.events import EventBatch
from kvatlas.core.keys import Namespace, ObjectKey
from kvatlas.core.types import ChunkHash, Incarnation, InstanceId, Tier


class KeyDirectory:
    """Object key -> placements, with a reverse index per L1 owner. Single-threaded."""

    __slots__ = ("reads", "tables", "writes")

    def __init__(self, keep_tokens: bool = False) -> None:
        """``keep_tokens``: bind the token ids that STORE entries carry to their keys
        (lookups answer them); the memory is spent only on entries that carry tokens."""
        self.tables = DirectoryTables(keep_tokens)
        """The state the two parts below share."""
        self.reads = DirectoryReads(self.tables)
        self.writes = DirectoryWrites(self.tables)

    @property
    def keep_tokens(self) -> bool:
        """Whether STORE entries' token ids are kept (set at construction)."""
        return self.tables.keep_tokens

    # ---- writes ----------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> Applied:
        """Apply one admitted batch. STORE upserts, ACCESS counts, DELETE removes.

        A batch's objects are its entries followed by its block's. Validates every entry
        and the block before changing anything, so a bad batch applies nothing.
        """
        return self.writes.apply(batch)

    def fence(self, instance_id: InstanceId, incarnation: Incarnation | None = None) -> int:
        """Remove the L1 placements of ``instance_id`` (of one incarnation, or of all),
        in time proportional to that instance's L1 keys; L2 placements stay. Returns the
        number of placements removed."""
        return self.writes.fence(instance_id, incarnation)

    def drop(self, instance_id: InstanceId) -> int:
        """Remove every placement of ``instance_id``: every tier, every incarnation (one
        pass over the map for the tiers without a reverse index). Returns the number of
        placements removed."""
        return self.writes.drop(instance_id)

    def fence_below(self, instance_id: InstanceId, incarnation: Incarnation) -> int:
        """Fence every L1 incarnation of ``instance_id`` lower than ``incarnation``."""
        return self.writes.fence_below(instance_id, incarnation)

    @classmethod
    def restore(cls, data: bytes, keep_tokens: bool = False) -> KeyDirectory:
        """Rebuild a directory from `snapshot` bytes by replaying its stores."""
        snap = decode_snapshot(data)
        d = cls(keep_tokens=keep_tokens)
        d.writes.replay(snap)
        return d

    # ---- reads -----------------------------------------------------------------------

    def lookup_keys(self, keys: Iterable[ObjectKey]) -> list[KeyResult]:
        """Placements of each key, in the order given (empty placements: unknown)."""
        return self.reads.lookup_keys(keys)

    def lookup_prefix(self, hashes: Sequence[ChunkHash], ns: Namespace) -> PrefixResult:
        """Per chunk of a prefix chain who holds it, and per (instance, tier) how many
        leading chunks it holds."""
        return self.reads.lookup_prefix(hashes, ns)

    def lookup_blob(self, blob: bytes, ns: Namespace) -> KeyColumns:
        """Placements of each hash of ``blob`` (full hashes, concatenated) in ``ns``."""
        return self.reads.lookup_blob(blob, ns)

    def iter_keys(
        self,
        tier: Tier | None = None,
        instance_id: InstanceId | None = None,
        backend: str | None = None,
    ) -> Iterator[tuple[Namespace, bytes, tuple[Placement, ...]]]:
        """Every key with its placements, filtered; the hash is the stored 8-byte prefix."""
        return self.reads.iter_keys(tier, instance_id, backend)

    def namespaces(self) -> list[Namespace]:
        """Every namespace that holds a key now."""
        return self.reads.namespaces()

    def key_order(self) -> list[int]:
        """Every key's id, in insertion order (a copy, to walk in steps)."""
        return self.reads.key_order()

    def key_slice(self, start: int, count: int) -> list[int]:
        """The ids of ``count`` keys from position ``start`` in insertion order."""
        return self.reads.key_slice(start, count)

    def key_rows(
        self,
        ids: Iterable[int],
        tier: Tier | None = None,
        instance_id: InstanceId | None = None,
        backend: str | None = None,
    ) -> list[tuple[Namespace, bytes, tuple[Placement, ...]]]:
        """The keys of ``ids`` that still have a placement matching the filters, with
        those placements, in order."""
        return self.reads.key_rows(ids, tier, instance_id, backend)

    def key_facts(self, ns: Namespace, prefix: bytes) -> tuple[int, int]:
        """(access count, number of kept token ids) of a listed key (0, 0 if gone)."""
        return self.reads.key_facts(ns, prefix)

    def tier_bytes(self, ids: Iterable[int], tier: Tier) -> dict[Namespace, int]:
        """Bytes of ``tier`` placements per namespace, over the keys of ``ids``."""
        return self.reads.tier_bytes(ids, tier)

    def __len__(self) -> int:
        return len(self.tables.map)

    def stats(self) -> DirectoryStats:
        return self.reads.stats()

    def canonical(self) -> list[tuple[Namespace, bytes, tuple[Placement, ...]]]:
        """The directory's content independent of interning order, for tests and digests."""
        return self.reads.canonical()

    def digest(self) -> str:
        """blake3 hex digest of the canonical content (placements and access counts)."""
        return self.reads.digest()

    def snapshot(self) -> bytes:
        """Encode the directory; `restore` replays it through the same store path."""
        return self.reads.snapshot()

    def capture(self) -> DirectoryCapture:
        """The directory at this instant, for `DirectoryCapture.encode` to turn into
        snapshot bytes later (a shell holds its lock only for this copy)."""
        return self.reads.capture()
