"""Builders of cache events and keys for the coordinator tests."""

from __future__ import annotations

import msgspec

from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import Namespace, ObjectKey, chunk_hashes, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.events_api import encode_events_json, encode_events_msgpack

MODEL = "llama"
RANK = default_kv_rank(1)


def key(h: bytes, model: str = MODEL) -> ObjectKey:
    return ObjectKey(h, model, RANK)


def fake_hash(i: int, salt: int = 0) -> bytes:
    """A 32-byte hash whose 8-byte prefix (what the directory keeps) is unique per (i, salt)."""
    return (salt.to_bytes(4, "big") + i.to_bytes(4, "big")) * 4


def batch(
    iid: str,
    seq: int,
    hashes: list[bytes],
    *,
    incarnation: int = 1,
    tier: Tier = Tier.L1,
    event: EventType = EventType.STORE,
    size: int = 1024,
    model: str = MODEL,
) -> EventBatch:
    return EventBatch(
        InstanceId(iid),
        Incarnation(incarnation),
        seq,
        event,
        tier,
        tuple(Entry(key(h, model), size) for h in hashes),
    )


def block_batch(
    iid: str,
    seq: int,
    hashes: list[bytes],
    *,
    head: tuple[bytes, ...] = (),
    incarnation: int = 1,
    tier: Tier = Tier.L1,
    event: EventType = EventType.STORE,
    size: int = 1024,
    model: str = MODEL,
) -> EventBatch:
    """A batch of ``head`` as entries, then ``hashes`` as a key block."""
    entries = batch(
        iid,
        seq,
        list(head),
        incarnation=incarnation,
        tier=tier,
        event=event,
        size=size,
        model=model,
    )
    return msgspec.structs.replace(entries, block=KeyBlock.of(Namespace(model, RANK), hashes, size))


def prompt_hashes(tokens: list[int], chunk_size: int = 256) -> list[bytes]:
    return list(chunk_hashes(tokens, chunk_size))


def json_body(*batches: EventBatch) -> bytes:
    return encode_events_json(list(batches))


def msgpack_body(*batches: EventBatch) -> bytes:
    return encode_events_msgpack(list(batches))


def register_body(iid: str, incarnation: int = 1, **extra: object) -> dict[str, object]:
    return {
        "instance_id": iid,
        "ip": "127.0.0.1",
        "http_port": 7555,
        "incarnation": incarnation,
        **extra,
    }
