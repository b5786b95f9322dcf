"""What the key directory answers, and the compact encoding placements live in.

Owns the result types (``Owner``, ``Placement``, ``KeyResult``, ``PrefixHolder``,
``KeyColumns``, ``PrefixResult``, ``Applied``, the stats) and the int layout of the
directory's map: a key is ``ns_id << 64 | first 8 bytes of the chunk hash``, a placement
code is ``owner_id << 40 | size_bytes``. Must not: hold state (``directory`` does) or know
the snapshot format (``directory_snapshot`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Final

import msgspec

from kvatlas.core.keys import Namespace, ObjectKey
from kvatlas.core.keys import object_keys as object_keys_of
from kvatlas.core.types import ChunkHash, Incarnation, InstanceId, Tier

SIZE_BITS: Final = 40
SIZE_MASK: Final = (1 << SIZE_BITS) - 1
HASH_BITS: Final = 64
HASH_MASK: Final = (1 << HASH_BITS) - 1

MapValue = int | tuple[int, ...]
"""A map value: one placement code, or a tuple of codes when a key has several."""


class Owner(msgspec.Struct, frozen=True, gc=False):
    """Who holds a placement: one process of one instance, in one tier and backend."""

    instance_id: InstanceId
    incarnation: Incarnation
    tier: Tier
    backend: str
    shared: bool


class Placement(msgspec.Struct, frozen=True, gc=False):
    """One copy of a chunk, as reported by its owner (a hint, not a promise)."""

    instance_id: InstanceId
    incarnation: Incarnation
    tier: Tier
    backend: str
    size_bytes: int
    shared: bool


class KeyResult(msgspec.Struct, frozen=True):
    """Placements of one key, with its access count and tokens when known."""

    key: ObjectKey
    placements: tuple[Placement, ...]
    access_count: int = 0
    token_ids: tuple[int, ...] | None = None


class PrefixHolder(msgspec.Struct, frozen=True):
    """How many leading chunks of a lookup one instance holds in one tier."""

    instance_id: InstanceId
    tier: Tier
    chunks: int


class KeyColumns(msgspec.Struct, frozen=True):
    """Per key of a lookup, in order: placements, access count, tokens (when kept)."""

    placements: tuple[tuple[Placement, ...], ...]
    access_counts: tuple[int, ...]
    token_ids: tuple[tuple[int, ...] | None, ...] | None


class PrefixResult(msgspec.Struct, frozen=True):
    """A lookup by token sequence: per chunk who holds it, per instance the longest prefix.

    Columnar (one tuple per field, one item per chunk) so that a 128-chunk lookup does
    not build 256 small objects; `keys()` and `results()` give the per-key view.
    """

    namespace: Namespace
    hashes: tuple[ChunkHash, ...]
    placements: tuple[tuple[Placement, ...], ...]
    access_counts: tuple[int, ...]
    token_ids: tuple[tuple[int, ...] | None, ...] | None
    holders: tuple[PrefixHolder, ...]
    """Sorted by chunks held (descending), then instance id, then tier."""

    def keys(self) -> list[ObjectKey]:
        return object_keys_of(self.hashes, self.namespace)

    def results(self) -> list[KeyResult]:
        toks = self.token_ids or (None,) * len(self.hashes)
        return [
            KeyResult(k, p, a, t)
            for k, p, a, t in zip(
                self.keys(), self.placements, self.access_counts, toks, strict=True
            )
        ]


class Applied(msgspec.Struct, frozen=True):
    """Outcome of applying one batch."""

    entries: int
    created: int = 0
    """Placements created (STORE) or removed (DELETE)."""
    ignored: int = 0
    """ACCESS or DELETE of a key the directory does not hold for this owner."""


class OwnerStats(msgspec.Struct, frozen=True):
    instance_id: InstanceId
    incarnation: Incarnation
    tier: Tier
    backend: str
    placements: int
    bytes: int
    shared: bool = False


class DirectoryStats(msgspec.Struct, frozen=True):
    keys: int
    placements: int
    bytes: int
    placements_by_tier: dict[str, int]
    bytes_by_tier: dict[str, int]
    owners: tuple[OwnerStats, ...]
    namespaces: int
    token_keys: int = 0
    """Keys whose chunk token ids are kept."""
    token_bytes: int = 0
    """Bytes of those token ids (4 per token)."""


def decode_placements(owners: Sequence[Owner], cur: MapValue) -> list[Placement]:
    """The placements a map value encodes (one code, or a tuple of codes)."""
    codes: tuple[int, ...] = (cur,) if type(cur) is int else cur  # type: ignore[assignment]
    return [
        Placement(o.instance_id, o.incarnation, o.tier, o.backend, c & SIZE_MASK, o.shared)
        for c in codes
        for o in (owners[c >> SIZE_BITS],)
    ]


def placement_order(p: Placement) -> tuple[str, int, Tier, str, bool]:
    return (p.instance_id, p.incarnation, p.tier, p.backend, p.shared)


def prefix_holders(placements: Sequence[tuple[Placement, ...]]) -> tuple[PrefixHolder, ...]:
    """Per (instance, tier), the number of leading chunks it holds.

    Runs of chunks share one interned placements tuple, so this walks runs, not chunks.
    """
    running: dict[tuple[InstanceId, Tier], int] = {}
    done: dict[tuple[InstanceId, Tier], int] = {}
    first = True
    for ps, run in groupby(placements):
        length = len(list(run))
        here = {(p.instance_id, p.tier) for p in ps}
        if first:
            running = dict.fromkeys(here, length)
            first = False
        else:
            for holder in list(running):
                if holder in here:
                    running[holder] += length
                else:
                    done[holder] = running.pop(holder)
        if not running:
            break
    done.update(running)
    return tuple(
        sorted(
            (PrefixHolder(inst, tier, n) for (inst, tier), n in done.items()),
            key=lambda h: (-h.chunks, h.instance_id, h.tier),
        )
    )
