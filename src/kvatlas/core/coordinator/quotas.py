"""Operator state of the fleet L2 eviction: per-``cache_salt`` quotas and the pin table.

What LMCache 0.5.6's coordinator keeps as its metadata document (``QuotaManager`` and
the pin counts of ``FleetEvictionController``), with its semantics:

- A quota is a byte limit per salt. A salt without one resolves to the *default*
  limit, which starts as None: unquota'd salts are exempt until an operator sets a
  default (0 then means "evict everything of unregistered salts").
- A pin is a count on a chunk's key, *without* its object group (a pin covers the chunk
  in every group), kept in the order keys were first pinned. Unpin lowers the count
  (floored at 0, the key leaves the table at 0); a forced delete drops the key outright.

Every change is an `OperatorOp` (a tagged msgspec Struct, so the same value travels in a
Kafka record) applied by `OperatorState.apply`, the one way in, which returns what the
HTTP answer reports. Replicas apply the same ops in log order and agree. Ops that come
from a log carry their position; one at or below the position the state already applied
is a no-op, so replaying a log over a restored state cannot count a pin twice.

Pure: no I/O, no clock, no locks (the shell holds one).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import msgspec

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import HASH_BYTES, ObjectKey, rank_keys
from kvatlas.core.types import U63, ChunkHash

GIB = 1024**3
"""LMCache's wire unit of quotas and usage (``_GB``)."""
SALT_FORBIDDEN = frozenset("@/\\\x00")
"""Characters LMCache's ``ObjectKey`` refuses in a ``cache_salt``."""
SALT_MAX_LEN = 128
DEFAULT_SALT_PATH = "_default"
"""What a path names the empty salt by (``/quota/_default``)."""


def check_key_fields(model_name: str, cache_salt: str) -> None:
    """LMCache's ``ObjectKey`` invariants on the fields a token-addressed request names;
    InvalidInput with LMCache's reason."""
    if "@" in model_name:
        raise InvalidInput(f"model_name must not contain '@' (got {model_name!r})")
    bad = SALT_FORBIDDEN & set(cache_salt)
    if bad:
        raise InvalidInput(f"cache_salt must not contain {bad!r} (got {cache_salt!r})")
    if len(cache_salt) > SALT_MAX_LEN:
        raise InvalidInput(f"cache_salt exceeds max length {SALT_MAX_LEN} (got {len(cache_salt)})")


def salt_from_path(segment: str) -> str:
    """The salt a path segment names (``_default`` is the empty salt)."""
    return "" if segment == DEFAULT_SALT_PATH else segment


def pin_key(key: ObjectKey) -> ObjectKey:
    """``key`` in object group 0: what the pin table counts (one pin covers every
    group of the chunk, as LMCache's ``_pinned_chunk_key``)."""
    if key.object_group_id == 0:
        return key
    return ObjectKey(key.chunk_hash, key.model_name, key.kv_rank, 0, key.cache_salt)


# ---- ops -------------------------------------------------------------------------------


class SetQuota(msgspec.Struct, frozen=True, tag="set_quota"):
    cache_salt: str
    limit_bytes: U63


class DeleteQuota(msgspec.Struct, frozen=True, tag="delete_quota"):
    cache_salt: str


class SetDefaultQuota(msgspec.Struct, frozen=True, tag="set_default_quota"):
    limit_bytes: U63 | None


class Pin(msgspec.Struct, frozen=True, tag="pin"):
    keys: tuple[ObjectKey, ...]


class Unpin(msgspec.Struct, frozen=True, tag="unpin"):
    keys: tuple[ObjectKey, ...]


class PinChunks(msgspec.Struct, frozen=True, tag="pin_chunks"):
    """`Pin` (or with ``unpin`` `Unpin`) of every rank's key of each chunk, object group
    0 (what a token-addressed request resolves to), carried as the chunk hashes: 32
    bytes a chunk instead of a key per rank, so a long prompt's pin fits a Kafka record
    (LMCache's 1,000,000 tokens: 125 kB whatever the world size)."""

    model_name: str
    world_size: Annotated[int, msgspec.Meta(ge=1, le=256)]
    cache_salt: str
    hashes: bytes
    unpin: bool = False

    def keys(self) -> list[ObjectKey]:
        if len(self.hashes) % HASH_BYTES:
            raise InvalidInput(f"pin hashes must be {HASH_BYTES} bytes each")
        hs = [
            ChunkHash(self.hashes[i : i + HASH_BYTES])
            for i in range(0, len(self.hashes), HASH_BYTES)
        ]
        return rank_keys(hs, self.model_name, self.world_size, self.cache_salt)


class DropPins(msgspec.Struct, frozen=True, tag="drop_pins"):
    """A forced delete's: the keys leave the pin table whatever their count."""

    keys: tuple[ObjectKey, ...]


OperatorOp = SetQuota | DeleteQuota | SetDefaultQuota | Pin | Unpin | PinChunks | DropPins


class OpResult(msgspec.Struct, frozen=True):
    """What applying an op did: ``found`` (DeleteQuota: an entry was removed) and
    ``skipped`` (True when the op's log position was already applied)."""

    found: bool = False
    skipped: bool = False


# ---- state -----------------------------------------------------------------------------


class PinnedKey(msgspec.Struct, frozen=True):
    key: ObjectKey
    pin_count: int


class OperatorCapture(msgspec.Struct, frozen=True):
    """The durable form of `OperatorState` (LMCache's ``quotas`` and ``pins`` sections)."""

    limits: dict[str, int]
    default_limit_bytes: int | None
    pins: list[PinnedKey]
    positions: dict[str, int] = {}
    """Log position key -> next offset, of the ops applied from a log."""


class OperatorState:
    """Quotas, the default quota and the pin table; single-threaded."""

    def __init__(self) -> None:
        self.limits: dict[str, int] = {}
        self.default_limit_bytes: int | None = None
        self._pins: dict[ObjectKey, int] = {}
        self.positions: dict[str, int] = {}

    # ---- the one way in -----------------------------------------------------------

    def apply(self, op: OperatorOp, position: tuple[str, int] | None = None) -> OpResult:
        """Apply ``op``; with a log ``position`` (key, next offset), skip it when that
        offset was applied already."""
        if position is not None:
            if self.positions.get(position[0], 0) >= position[1]:
                return OpResult(skipped=True)
            self.positions[position[0]] = position[1]
        if isinstance(op, SetQuota):
            self.limits[op.cache_salt] = op.limit_bytes
        elif isinstance(op, DeleteQuota):
            return OpResult(found=self.limits.pop(op.cache_salt, None) is not None)
        elif isinstance(op, SetDefaultQuota):
            self.default_limit_bytes = op.limit_bytes
        elif isinstance(op, Pin):
            self._pin(op.keys)
        elif isinstance(op, Unpin):
            self._unpin(op.keys)
        elif isinstance(op, PinChunks):
            (self._unpin if op.unpin else self._pin)(op.keys())
        else:
            for key in op.keys:
                self._pins.pop(pin_key(key), None)
        return OpResult()

    def _pin(self, keys: Iterable[ObjectKey]) -> None:
        for key in keys:
            k = pin_key(key)
            self._pins[k] = self._pins.get(k, 0) + 1

    def _unpin(self, keys: Iterable[ObjectKey]) -> None:
        for key in keys:
            k = pin_key(key)
            count = self._pins.get(k, 0)
            if count <= 1:
                self._pins.pop(k, None)
            else:
                self._pins[k] = count - 1

    # ---- reads --------------------------------------------------------------------

    def effective_limit(self, cache_salt: str) -> int | None:
        """The salt's limit, else the default (None: exempt from eviction)."""
        explicit = self.limits.get(cache_salt)
        return explicit if explicit is not None else self.default_limit_bytes

    def is_pinned(self, key: ObjectKey) -> bool:
        return pin_key(key) in self._pins

    def unpinned(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """The keys without a pin, in order (a non-forced delete keeps the rest)."""
        pins = self._pins
        return [k for k in keys if pin_key(k) not in pins]

    def pin_page(
        self, cache_salt: str, model_name: str, offset: int, limit: int
    ) -> tuple[int, list[PinnedKey]]:
        """The number of pinned keys matching the filters (empty: any) and one page of
        them, in first-pinned order."""
        matching = [
            PinnedKey(k, n)
            for k, n in self._pins.items()
            if (not cache_salt or k.cache_salt == cache_salt)
            and (not model_name or k.model_name == model_name)
        ]
        return len(matching), matching[offset : offset + limit]

    def pins_by_salt(self) -> dict[str, int]:
        """Pinned keys per salt (the fleet page)."""
        out: dict[str, int] = {}
        for k in self._pins:
            out[k.cache_salt] = out.get(k.cache_salt, 0) + 1
        return out

    @property
    def pinned_keys(self) -> int:
        return len(self._pins)

    # ---- durability ---------------------------------------------------------------

    def capture(self) -> OperatorCapture:
        return OperatorCapture(
            dict(self.limits),
            self.default_limit_bytes,
            [PinnedKey(k, n) for k, n in self._pins.items()],
            dict(self.positions),
        )

    @classmethod
    def restore(cls, capture: OperatorCapture) -> OperatorState:
        """The state a capture holds; counts below 1 are dropped, keys in two groups
        fold into one (as LMCache's restore)."""
        state = cls()
        state.limits = dict(capture.limits)
        state.default_limit_bytes = capture.default_limit_bytes
        for pinned in capture.pins:
            if pinned.pin_count > 0:
                k = pin_key(pinned.key)
                state._pins[k] = state._pins.get(k, 0) + pinned.pin_count
        state.positions = dict(capture.positions)
        return state
