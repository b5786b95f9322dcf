"""Message shapes of the coordinator's fleet configuration routes (LMCache 0.5.7).

``PUT /config/chunk-size`` (LMCache's ``ChunkSizeBindRequest`` and
``ChunkSizeBindResponse``) and the `ChunkSize` type a registration's ``chunk_size``
shares with it: a server tells the coordinator the chunk size its negotiation settled
on, and the coordinator binds to it once (`core.fleet.FleetState.bind_chunk_size`).

Owns encoding of shapes only; no I/O and no state.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvatlas.core.types import MAX_INT64

ChunkSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT64)]
"""Tokens per chunk as a server sends it: LMCache's ``Field(ge=1)``."""


class ChunkSizeBindRequest(msgspec.Struct, frozen=True):
    """`PUT /config/chunk-size`: the fleet's final chunk size."""

    chunk_size: ChunkSize


class ChunkSizeBindResponse(msgspec.Struct, frozen=True):
    """The coordinator's chunk size after a successful binding."""

    chunk_size: int
