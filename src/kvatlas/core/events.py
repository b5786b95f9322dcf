"""Cache events: STORE / ACCESS / DELETE / CONFIG batches as reported by one server process.

A batch belongs to one (instance id, incarnation, seq, tier, backend, shared); the seq
is per batch and starts at 1 for every incarnation. Semantics, applied by the directory:
STORE is an upsert, ACCESS never creates a record, DELETE of something absent is a no-op.
CONFIG carries no objects: it declares the capacity of its (tier, backend), as one part
of the sender's declaration number ``capacity_revision`` (`core.capacity`).

A batch of an event type this coordinator does not know (a newer sender's) is an
`UnknownBatch`: only what the gate needs (instance, incarnation, seq) and its type name.
It passes the gate, so the next seq is not a gap, and changes nothing else.

A batch carries its objects in up to two forms, and means its ``entries`` followed by
the entries of its ``block``:

- ``entries``: one `Entry` per object, each with its full key and optional tokens;
- ``block``: a `KeyBlock`, the columnar form of token-less objects of one namespace
  (one bytes blob of concatenated 32-byte hashes and one tuple of sizes). A 256-object
  block decodes into three objects instead of 512 and the directory reads its key ints
  straight from the blob, which is what lets one core ingest millions of events/s.

Consumers that count or walk objects use `EventBatch.n_entries` and
`EventBatch.all_entries()`, never ``len(entries)``. A block's shape (blob length against
sizes) is checked by whoever applies or accepts it (`KeyBlock.check_shape`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter

import msgspec

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import HASH_BYTES, Namespace, ObjectKey, same_namespace
from kvatlas.core.types import U63, EventType, InstanceId, Tier, TokenOffset, WireIncarnation


class Entry(msgspec.Struct, frozen=True, gc=False):
    """One object in a batch."""

    key: ObjectKey
    size_bytes: U63 = 0
    token_ids: tuple[int, ...] | None = None
    """The chunk's tokens, when the emitter sends them (blend lookup needs them)."""
    token_offset: TokenOffset = -1
    """Position of the chunk's first token in its sequence; -1 means unknown."""


_get_key = attrgetter("key")
_get_hash = attrgetter("chunk_hash")
_get_size = attrgetter("size_bytes")
_get_tokens = attrgetter("token_ids")
_get_offset = attrgetter("token_offset")


class KeyBlock(msgspec.Struct, frozen=True, gc=False):
    """Token-less objects of one namespace, as columns (the fast form of entries)."""

    namespace: Namespace
    hashes: bytes
    """The chunk hashes, ``HASH_BYTES`` each, concatenated in order."""
    sizes: tuple[int, ...]
    """One size in bytes per hash."""

    @classmethod
    def of(
        cls, namespace: Namespace, hashes: Sequence[bytes], sizes: int | Iterable[int]
    ) -> KeyBlock:
        """A block of ``hashes`` in ``namespace``; ``sizes`` is one int for all or one each.

        Raises InvalidInput unless every hash has ``HASH_BYTES`` bytes and there is one
        size per hash.
        """
        if any(len(h) != HASH_BYTES for h in hashes):
            raise InvalidInput(f"every chunk hash of a key block must have {HASH_BYTES} bytes")
        sz = (sizes,) * len(hashes) if isinstance(sizes, int) else tuple(sizes)
        block = cls(namespace, b"".join(hashes), sz)
        block.check_shape()
        return block

    @classmethod
    def from_entries(cls, entries: Sequence[Entry]) -> KeyBlock | None:
        """The block equivalent to ``entries``, or None when there is none: when an entry
        carries tokens or a known offset, the keys span namespaces, a hash does not have
        ``HASH_BYTES`` bytes, or there are no entries."""
        if not entries:
            return None
        n = len(entries)
        if list(map(_get_tokens, entries)) != [None] * n:
            return None
        if list(map(_get_offset, entries)) != [-1] * n:
            return None
        keys = list(map(_get_key, entries))
        if not same_namespace(keys):
            return None
        hashes = list(map(_get_hash, keys))
        if set(map(len, hashes)) != {HASH_BYTES}:
            return None
        return cls(keys[0].namespace, b"".join(hashes), tuple(map(_get_size, entries)))

    @property
    def count(self) -> int:
        """Number of objects in the block."""
        return len(self.sizes)

    def check_shape(self) -> None:
        """Raise InvalidInput unless the blob holds exactly one hash per size."""
        if len(self.hashes) != HASH_BYTES * len(self.sizes):
            raise InvalidInput(
                f"key block hashes must be {HASH_BYTES} bytes per size: got"
                f" {len(self.hashes)} bytes of hashes for {len(self.sizes)} sizes"
            )

    def hash_list(self) -> list[bytes]:
        """The chunk hashes, one bytes object each."""
        self.check_shape()
        blob = self.hashes
        return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]

    def entries(self) -> tuple[Entry, ...]:
        """The equivalent entries (no tokens, unknown offset), in order."""
        ns = self.namespace
        m, r, g, s = ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt
        return tuple(
            Entry(ObjectKey(h, m, r, g, s), size)
            for h, size in zip(self.hash_list(), self.sizes, strict=True)
        )


class EventBatch(msgspec.Struct, frozen=True):
    """A batch of events of one kind from one server process: ``entries``, then ``block``."""

    instance_id: InstanceId
    incarnation: WireIncarnation
    seq: U63
    event_type: EventType
    tier: Tier
    entries: tuple[Entry, ...]
    backend: str = "cpu"
    shared: bool = False
    ts: float = 0.0
    block: KeyBlock | None = None
    """More objects after ``entries``, in columnar form (optional: older emitters and the
    JSON form never send one)."""
    capacity_bytes: U63 = 0
    """CONFIG only: the capacity of (tier, backend); 0 declares none."""
    capacity_revision: U63 = 0
    """CONFIG only: which declaration of the sender this batch belongs to."""
    dropped_events: U63 = 0
    """Events (entries) this incarnation of the sender had dropped before they reached
    the coordinator, when the batch was built (LMCache 0.5.7): cumulative, so the next
    batch that gets through reports a loss. 0 from senders that do not report it."""

    @property
    def n_entries(self) -> int:
        """Number of objects in the batch, ``entries`` and ``block`` together."""
        block = self.block
        return len(self.entries) if block is None else len(self.entries) + len(block.sizes)

    def all_entries(self) -> tuple[Entry, ...]:
        """Every object as an `Entry`: ``entries`` followed by the block's."""
        if self.block is None:
            return self.entries
        return self.entries + self.block.entries()


class UnknownBatch(msgspec.Struct, frozen=True, gc=False):
    """A batch whose ``event_type`` this coordinator does not know: what the gate needs."""

    instance_id: InstanceId
    incarnation: WireIncarnation
    seq: U63
    event_type: str
