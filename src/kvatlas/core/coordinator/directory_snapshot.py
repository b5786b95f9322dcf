"""The key directory's snapshot: a point-in-time capture, its encoding and its decoding.

Owns the snapshot format (``DirectorySnapshot``, version ``SNAPSHOT_VERSION``: namespaces,
per owner its keys and sizes, access counts, token bindings), ``DirectoryCapture`` (the
copy a shell takes under its lock, encoded and digested after the lock is released) and
``decode_snapshot`` (bytes -> format, refusing what it cannot read). Must not: rebuild a
directory (``KeyDirectory.restore`` replays the decoded stores through the write path,
``DirectoryWrites.replay``).
"""

from __future__ import annotations

from typing import Final

import msgspec
from blake3 import blake3

from kvatlas.core.coordinator.placements import (
    HASH_BITS,
    HASH_MASK,
    SIZE_BITS,
    SIZE_MASK,
    MapValue,
    Owner,
    Placement,
    decode_placements,
    placement_order,
)
from kvatlas.core.errors import SnapshotError
from kvatlas.core.keys import Namespace

SNAPSHOT_VERSION: Final = 2
"""2: keys travel as (namespace index, 64-bit hash prefix). Version 1 wrote the directory's
own key ints (``ns_id << 64 | prefix``), which msgpack cannot hold once a second
namespace exists, so a version-1 file only ever holds namespace 0; it still restores."""


class SnapshotOwner(msgspec.Struct, array_like=True):
    """The keys one owner holds in one namespace, with their sizes."""

    owner: Owner
    namespace: int
    """Index into ``DirectorySnapshot.namespaces``."""
    keys: list[int]
    """64-bit hash prefixes."""
    sizes: list[int]


class DirectorySnapshot(msgspec.Struct, array_like=True):
    version: int
    namespaces: list[Namespace]
    owners: list[SnapshotOwner]
    access: list[tuple[int, int, int]]
    """(namespace index, hash prefix, access count)."""
    tokens: list[tuple[int, int, int, bytes]]
    """(namespace index, hash prefix, token offset, uint32 tokens)."""


class _Version(msgspec.Struct, array_like=True):
    """The leading field of every version (the rest is ignored when reading it)."""

    version: int


class _OwnerV1(msgspec.Struct, array_like=True):
    owner: Owner
    keys: list[int]
    sizes: list[int]


class _SnapshotV1(msgspec.Struct, array_like=True):
    version: int
    namespaces: list[Namespace]
    owners: list[_OwnerV1]
    access: list[tuple[int, int]]
    tokens: list[tuple[int, int, bytes]]


class DirectoryCapture:
    """A point-in-time copy of a `KeyDirectory`'s state (see `KeyDirectory.capture`)."""

    def __init__(
        self,
        keys: dict[int, MapValue],
        owners: tuple[Owner, ...],
        namespaces: tuple[Namespace, ...],
        access: dict[int, int],
        tokens: dict[int, tuple[int, bytes]],
    ) -> None:
        self._keys = keys
        self._owners = owners
        self._namespaces = namespaces
        self._access = access
        self._tokens = tokens

    def _placements(self, cur: MapValue) -> tuple[Placement, ...]:
        return tuple(sorted(decode_placements(self._owners, cur), key=placement_order))

    def _canonical_rows(self) -> list[tuple[Namespace, bytes, tuple[Placement, ...], int]]:
        """(namespace, hash prefix, sorted placements, access count) per key, sorted by
        namespace and prefix: the content independent of interning order."""
        rows = []
        for ik, cur in self._keys.items():
            ns = self._namespaces[ik >> HASH_BITS]
            prefix = (ik & HASH_MASK).to_bytes(8, "big")
            rows.append((ns, prefix, self._placements(cur), self._access.get(ik, 0)))
        rows.sort(
            key=lambda r: (
                r[0].model_name,
                r[0].kv_rank,
                r[0].object_group_id,
                r[0].cache_salt,
                r[1],
            )
        )
        return rows

    def canonical(self) -> list[tuple[Namespace, bytes, tuple[Placement, ...]]]:
        """The content independent of interning order (see `KeyDirectory.canonical`)."""
        return [(ns, prefix, ps) for ns, prefix, ps, _ in self._canonical_rows()]

    def digest(self) -> str:
        """blake3 hex digest of the canonical content (placements and access counts)."""
        h = blake3()
        enc = msgspec.msgpack.Encoder()
        for row in self._canonical_rows():
            h.update(enc.encode(row))
        digest: str = h.hexdigest()
        return digest

    def encode(self) -> bytes:
        """The snapshot bytes; `KeyDirectory.restore` replays them."""
        per_owner: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        if not self._keys or max(self._keys) <= HASH_MASK:
            # The common case, one namespace with id 0: a key int is its own prefix, and
            # the split per key below (a third of the encoding time) can be skipped.
            per_oid: dict[int, tuple[list[int], list[int]]] = {}
            for ik, cur in self._keys.items():
                codes: tuple[int, ...] = (cur,) if type(cur) is int else cur  # type: ignore[assignment]
                for c in codes:
                    ks, ss = per_oid.setdefault(c >> SIZE_BITS, ([], []))
                    ks.append(ik)
                    ss.append(c & SIZE_MASK)
            per_owner = {(o, 0): lists for o, lists in per_oid.items()}
        else:
            for ik, cur in self._keys.items():
                ns, prefix = ik >> HASH_BITS, ik & HASH_MASK
                codes = (cur,) if type(cur) is int else cur  # type: ignore[assignment]
                for c in codes:
                    ks, ss = per_owner.setdefault((c >> SIZE_BITS, ns), ([], []))
                    ks.append(prefix)
                    ss.append(c & SIZE_MASK)
        snap = DirectorySnapshot(
            version=SNAPSHOT_VERSION,
            namespaces=list(self._namespaces),
            owners=[
                SnapshotOwner(self._owners[o], ns, ks, ss)
                for (o, ns), (ks, ss) in per_owner.items()
            ],
            access=[(ik >> HASH_BITS, ik & HASH_MASK, n) for ik, n in self._access.items()],
            tokens=[
                (ik >> HASH_BITS, ik & HASH_MASK, off, toks)
                for ik, (off, toks) in self._tokens.items()
            ],
        )
        return msgspec.msgpack.encode(snap)


def decode_snapshot(data: bytes) -> DirectorySnapshot:
    """The snapshot format from bytes; SnapshotError when undecodable or of another version."""
    try:
        version = msgspec.msgpack.decode(data, type=_Version).version
        if version == 1:
            return _upgrade_v1(msgspec.msgpack.decode(data, type=_SnapshotV1))
        if version != SNAPSHOT_VERSION:
            raise SnapshotError(f"directory snapshot version {version} is not supported")
        return msgspec.msgpack.decode(data, type=DirectorySnapshot)
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"directory snapshot cannot be decoded: {exc}") from exc


def _upgrade_v1(old: _SnapshotV1) -> DirectorySnapshot:
    """Version 1 could only be written with every key in namespace 0 (its key ints were
    the bare prefixes then); anything else is not a file version 1 wrote."""
    if any(k > HASH_MASK for o in old.owners for k in o.keys):
        raise SnapshotError("directory snapshot version 1 holds a key outside namespace 0")
    return DirectorySnapshot(
        version=SNAPSHOT_VERSION,
        namespaces=old.namespaces,
        owners=[SnapshotOwner(o.owner, 0, o.keys, o.sizes) for o in old.owners],
        access=[(0, ik, n) for ik, n in old.access],
        tokens=[(0, ik, off, toks) for ik, off, toks in old.tokens],
    )
