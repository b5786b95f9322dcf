"""Typed identities shared by every layer.

Owns the small vocabulary (instance ids, incarnations, tiers, event types) so that a
`str` that is an instance id can never be passed where a backend name is expected.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final, NewType

import msgspec

ChunkHash = NewType("ChunkHash", bytes)
"""32-byte blake3 digest of a chunk in the prefix chain."""

MAX_INT64: Final = 2**63 - 1
"""The largest integer the coordinator keeps: every encoder (msgpack snapshots, JSON
readers in other languages, int64 columns) holds it."""
U63 = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]
"""A count, seq, incarnation, size or offset as it may arrive on the wire: msgspec
refuses anything outside [0, 2**63-1] at decode, with the field's path in the reason."""
I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=MAX_INT64)]
"""A signed integer on the wire that must fit 64 bits (kv ranks, group ids)."""
TokenOffset = Annotated[int, msgspec.Meta(ge=-1, le=MAX_INT64)]
"""Position of a chunk's first token in its sequence; -1: unknown."""
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
"""A TCP port on the wire (0: none)."""

InstanceId = NewType("InstanceId", str)
"""Name of a cache server in the fleet (``node-a``)."""

Incarnation = NewType("Incarnation", int)
"""Strictly increasing per process start of one instance id."""
WireIncarnation = Annotated[Incarnation, msgspec.Meta(ge=0, le=MAX_INT64)]
"""An incarnation as it may arrive on the wire: an `Incarnation` bounded like `U63`."""


class Tier(enum.StrEnum):
    """Where a placement lives. L1 dies with its process, L2 outlives it."""

    L1 = "l1"
    L2 = "l2"


class EventType(enum.StrEnum):
    """The cache lifecycle events a server reports. CONFIG carries no placement: it
    declares the capacity of one (tier, backend) of the sender (LMCache's servers open
    their event streams with it)."""

    STORE = "store"
    ACCESS = "access"
    DELETE = "delete"
    CONFIG = "config"
