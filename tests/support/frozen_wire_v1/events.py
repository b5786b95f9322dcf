"""FROZEN (see the package docstring): never edit. The first release's event encodings
(``kvatlas.wire.events_api``, ``kvatlas.wire.http_api.KeyWire``,
``kvatlas.wire.kafka_records``): the bodies of ``POST /events`` (kvatlas' compact
msgpack, version 2, and LMCache's JSON) and the batch records of the Kafka topic (one
bare msgpack ``EventBatch``, or JSON)."""

from __future__ import annotations

from typing import Literal

import msgspec

from .shapes import I64, U63, EventBatch, InstanceId, TokenOffset, WireIncarnation

COMPACT_VERSION = 2
MAGIC = b"KVM1"
MSGPACK_CONTENT_TYPE = "application/msgpack"
JSON_CONTENT_TYPE = "application/json"


class KeyWire(msgspec.Struct, frozen=True):
    chunk_hash_hex: str
    model_name: str
    kv_rank: I64
    object_group_id: I64 = 0
    cache_salt: str = ""


class EntryWire(msgspec.Struct, frozen=True):
    key: KeyWire
    size_bytes: U63 = 0
    token_ids: list[int] | None = None
    token_offset: TokenOffset = -1


class BatchWire(msgspec.Struct, frozen=True):
    instance_id: InstanceId
    incarnation: WireIncarnation
    seq: U63
    event_type: Literal["store", "access", "delete", "config"]
    tier: Literal["l1", "l2"]
    entries: list[EntryWire]
    backend: str = "cpu"
    shared: bool = False
    ts: float = 0.0
    capacity_bytes: int = 0
    capacity_revision: int = 0


class EventsRequest(msgspec.Struct, frozen=True):
    batches: list[BatchWire] = []


class CompactEvents(msgspec.Struct, frozen=True):
    batches: list[EventBatch]
    version: int = COMPACT_VERSION


class EventsResponse(msgspec.Struct, frozen=True):
    applied: int
    duplicates: int
    stale: int
    gaps: int = 0
    missing_seqs: int = 0
    provisional: int = 0
    skipped: dict[str, int] = {}


def batch_from_core(b: EventBatch) -> BatchWire:
    """A batch without a block in the JSON form (the first release expanded blocks)."""
    return BatchWire(
        instance_id=b.instance_id,
        incarnation=b.incarnation,
        seq=b.seq,
        event_type=b.event_type,
        tier=b.tier,
        entries=[
            EntryWire(
                KeyWire(
                    e.key.chunk_hash.hex(),
                    e.key.model_name,
                    e.key.kv_rank,
                    e.key.object_group_id,
                    e.key.cache_salt,
                ),
                e.size_bytes,
                list(e.token_ids) if e.token_ids is not None else None,
                e.token_offset,
            )
            for e in b.entries
        ],
        backend=b.backend,
        shared=b.shared,
        ts=b.ts,
        capacity_bytes=b.capacity_bytes,
        capacity_revision=b.capacity_revision,
    )


def encode_events_json(batches: list[EventBatch]) -> bytes:
    return msgspec.json.encode(EventsRequest([batch_from_core(b) for b in batches]))


def encode_events_msgpack(batches: list[EventBatch]) -> bytes:
    return msgspec.msgpack.encode(CompactEvents(batches))


def encode_batch_msgpack(batch: EventBatch) -> bytes:
    """A Kafka batch record: the batch as it is, no version."""
    return msgspec.msgpack.encode(batch)


events_response = msgspec.json.Decoder(EventsResponse)
