"""Typed identities shared by every layer.

Owns the small vocabulary (instance ids, incarnations, tiers, event types) so that a
`str` that is an instance id can never be passed where a backend name is expected.
"""

from __future__ import annotations

import enum
from typing import NewType

ChunkHash = NewType("ChunkHash", bytes)
"""32-byte blake3 digest of a chunk in the prefix chain."""

InstanceId = NewType("InstanceId", str)
"""Name of a cache server in the fleet (``node-a``)."""

Incarnation = NewType("Incarnation", int)
"""Strictly increasing per process start of one instance id."""


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
