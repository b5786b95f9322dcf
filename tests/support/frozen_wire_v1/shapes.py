"""FROZEN (see the package docstring): never edit. The core shapes the first release's
wire carried (``kvatlas.core.types``, ``kvatlas.core.keys``, ``kvatlas.core.events``),
as shapes only."""

from __future__ import annotations

from typing import Annotated, Final, Literal, NewType

import msgspec

MAX_INT64: Final = 2**63 - 1
HASH_ALGORITHM: Final = "blake3"
ChunkHash = NewType("ChunkHash", bytes)
U63 = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]
I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=MAX_INT64)]
TokenOffset = Annotated[int, msgspec.Meta(ge=-1, le=MAX_INT64)]
InstanceId = NewType("InstanceId", str)
WireIncarnation = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]
Tier = Literal["l1", "l2"]
EventType = Literal["store", "access", "delete", "config"]


class Namespace(msgspec.Struct, frozen=True, gc=False):
    model_name: str
    kv_rank: I64
    object_group_id: I64 = 0
    cache_salt: str = ""


class ObjectKey(msgspec.Struct, frozen=True, gc=False):
    chunk_hash: bytes
    model_name: str
    kv_rank: I64
    object_group_id: I64 = 0
    cache_salt: str = ""


class Entry(msgspec.Struct, frozen=True, gc=False):
    key: ObjectKey
    size_bytes: U63 = 0
    token_ids: tuple[int, ...] | None = None
    token_offset: TokenOffset = -1


class KeyBlock(msgspec.Struct, frozen=True, gc=False):
    namespace: Namespace
    hashes: bytes
    sizes: tuple[int, ...]


class EventBatch(msgspec.Struct, frozen=True):
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
    capacity_bytes: U63 = 0
    capacity_revision: U63 = 0
