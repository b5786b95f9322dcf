"""Cache events: STORE / ACCESS / DELETE batches as reported by one server process.

A batch belongs to one (instance id, incarnation, seq, tier, backend, shared); the seq
is per batch and starts at 1 for every incarnation. Semantics, applied by the directory:
STORE is an upsert, ACCESS never creates a record, DELETE of something absent is a no-op.
"""

from __future__ import annotations

import msgspec

from kvatlas.core.keys import ObjectKey
from kvatlas.core.types import EventType, Tier


class Entry(msgspec.Struct, frozen=True, gc=False):
    """One object in a batch."""

    key: ObjectKey
    size_bytes: int = 0
    token_ids: tuple[int, ...] | None = None
    """The chunk's tokens, when the emitter sends them (blend lookup needs them)."""
    token_offset: int = -1
    """Position of the chunk's first token in its sequence; -1 means unknown."""


class EventBatch(msgspec.Struct, frozen=True):
    """A batch of events of one kind from one server process."""

    instance_id: str
    incarnation: int
    seq: int
    event_type: EventType
    tier: Tier
    entries: tuple[Entry, ...]
    backend: str = "cpu"
    shared: bool = False
    ts: float = 0.0
