"""The shapes of the Mooncake KV Indexer RFC routes (kvcache-ai/Mooncake#1403) as NVIDIA
Dynamo 1.6.1's standalone indexer takes and answers them: requests (unknown fields
ignored, as Dynamo's serde does) and answers, including ``/dump``'s stored events.

Owns the shapes only. Must not: decide anything (`kvatlas.coordinator.indexer.api`
serves the routes, `kvatlas.coordinator.indexer.registry` keeps the workers).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

DEFAULT = "default"
"""Dynamo's default ``routing_group`` and ``tenant_id``."""
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]
"""At most 2**64 - 1 too: the route checks it (msgspec bounds stop at int64)."""
I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


# -- request and answer shapes (unknown fields are ignored, as Dynamo's serde does) ----


class RegisterRequest(msgspec.Struct, frozen=True):
    instance_id: U64
    endpoint: str
    model_name: str
    block_size: U32
    routing_group: str = DEFAULT
    tenant_id: str = DEFAULT
    """Accepted and ignored, as Dynamo does: one engine serves every tenant."""
    dp_rank: U32 | None = None
    replay_endpoint: str | None = None


class UnregisterRequest(msgspec.Struct, frozen=True):
    instance_id: U64
    model_name: str
    routing_group: str | None = None
    """None: wherever the instance is registered for ``model_name``."""
    tenant_id: str | None = None
    """Accepted and ignored, as Dynamo does."""
    dp_rank: U32 | None = None
    """None: every rank of the instance."""


class QueryRequest(msgspec.Struct, frozen=True):
    token_ids: list[U32]
    model_name: str
    routing_group: str = DEFAULT
    tenant_id: str = DEFAULT
    """Whose salt the lookup hashes with (``--tenants``); ``default``: none."""
    lora_name: str | None = None
    cache_salt: str | None = None
    """vLLM's request field, as the engine saw it."""


class QueryByHashRequest(msgspec.Struct, frozen=True):
    block_hashes: list[I64]
    """Dynamo's local block hashes (``LocalBlockHash`` as i64)."""
    model_name: str
    routing_group: str = DEFAULT
    tenant_id: str = DEFAULT
    cache_salt: str | None = None
    """Refused when set: local hashes carry no salt."""


class StatusResponse(msgspec.Struct, frozen=True):
    status: str


class InstanceSummary(msgspec.Struct, frozen=True):
    """The RFC's per-instance answer, in tokens; ``cpu`` and ``disk`` cumulative."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class ScoreResponse(msgspec.Struct, frozen=True):
    scores: dict[str, dict[str, int]]
    """instance_id -> dp_rank -> leading tokens on GPU (matched workers only)."""
    frequencies: list[int]
    instances: dict[str, InstanceSummary]


class ListenerInfo(msgspec.Struct, frozen=True):
    endpoint: str
    status: str


class WorkerInfo(msgspec.Struct, frozen=True):
    instance_id: int
    source: str
    status: str
    model_name: str
    routing_group: str
    block_size: int
    endpoints: dict[str, str]
    listeners: dict[str, ListenerInfo]


class DumpBlock(msgspec.Struct, frozen=True):
    block_hash: int
    tokens_hash: int
    mm_extra_info: None = None


class DumpStored(msgspec.Struct, frozen=True):
    parent_hash: int | None
    start_position: None
    blocks: list[DumpBlock]


class DumpData(msgspec.Struct, frozen=True):
    stored: DumpStored


class DumpKvEvent(msgspec.Struct, frozen=True):
    event_id: int
    data: DumpData
    dp_rank: int


class DumpEvent(msgspec.Struct, frozen=True):
    worker_id: int
    storage_tier: str
    residency_domain: str
    event: DumpKvEvent


class DumpPartition(msgspec.Struct, frozen=True):
    block_size: int
    events: list[DumpEvent]
