"""The forward-compatibility rule of event bodies and Kafka records, and `config` batches.

A batch of an unknown event type decodes into an `UnknownBatch` (only instance,
incarnation, seq and type are read); a malformed batch of a known type fails the whole
body, naming the batch. LMCache's own shapes (its `config` batches, ``token_ids: []``,
its Kafka records ``{"batches": [batch]}``) decode as LMCache means them.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from coordinator import lmcache_shapes
from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import Entry, EventBatch, UnknownBatch
from kvatlas.core.keys import ObjectKey, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.events_api import decode_events, encode_events_msgpack
from kvatlas.wire.http_api import MSGPACK_CONTENT_TYPE
from kvatlas.wire.kafka_records import decode_record

JSON = "application/json"
RANK = default_kv_rank()
KEY = {"chunk_hash_hex": "ab" * 32, "model_name": "m", "kv_rank": RANK}


def lmcache_batch(seq: int, event_type: str, **fields: Any) -> dict[str, Any]:
    """A batch of instance ``mp-1`` as LMCache 0.5.6 writes it."""
    return lmcache_shapes.lmcache_batch("mp-1", seq, event_type, **fields)


def body(*batches: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"batches": list(batches)})


def test_lmcache_config_and_store_batches_decode() -> None:
    config = lmcache_batch(1, "config", capacity_bytes=1 << 30, capacity_revision=1)
    store = lmcache_batch(
        2,
        "store",
        entries=[{"key": KEY, "size_bytes": 4096, "token_ids": [5, 6], "token_offset": 0}],
    )
    access = lmcache_batch(
        3, "access", backend="", entries=[{"key": KEY, "size_bytes": 0, "token_ids": []}]
    )
    got = decode_events(body(config, store, access), JSON, 100)
    assert [b.event_type for b in got] == [EventType.CONFIG, EventType.STORE, EventType.ACCESS]
    c, s, a = got
    assert isinstance(c, EventBatch) and (c.capacity_bytes, c.capacity_revision) == (1 << 30, 1)
    key = ObjectKey(bytes.fromhex("ab" * 32), "m", RANK)
    assert isinstance(s, EventBatch) and s.entries == (Entry(key, 4096, (5, 6), 0),)
    assert isinstance(a, EventBatch) and a.entries == (Entry(key, 0, None, -1),)  # [] is none


def test_unknown_types_are_unknown_batches_and_known_ones_still_decode() -> None:
    future = {"instance_id": "mp-1", "incarnation": 1760000000, "seq": 2, "event_type": "pin"}
    future["pins"] = {"shape": ["anything", 1]}  # a newer sender's fields, of any shape
    got = decode_events(
        body(lmcache_batch(1, "config"), future, lmcache_batch(3, "delete")), JSON, 9
    )
    assert got[1] == UnknownBatch(InstanceId("mp-1"), Incarnation(1760000000), 2, "pin")
    assert [type(b) for b in got] == [EventBatch, UnknownBatch, EventBatch]
    # msgpack too: a compact body with a batch of a type from the future
    known = EventBatch(InstanceId("k"), Incarnation(1), 1, EventType.STORE, Tier.L1, ())
    raw = msgspec.msgpack.decode(encode_events_msgpack([known]))
    raw["batches"].append({"instance_id": "k", "incarnation": 1, "seq": 2, "event_type": "hint"})
    got = decode_events(msgspec.msgpack.encode(raw), MSGPACK_CONTENT_TYPE, 9)
    assert got == [known, UnknownBatch(InstanceId("k"), Incarnation(1), 2, "hint")]


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (lmcache_batch(2, "store", entries=[{"key": KEY, "size_bytes": "x"}]), r"\$\.batches\[1\]"),
        (lmcache_batch(2, "config", entries=[{"key": KEY}]), "carries no entries"),
        (lmcache_batch(2, "config", backend=""), "must name its backend"),
        (lmcache_batch(2, "config", capacity_bytes=-1), "must be >= 0"),
        (lmcache_batch(2, "store", tier="l3"), r"\$\.batches\[1\]\.tier"),
        ({"instance_id": "mp-1", "incarnation": 1, "event_type": "pin"}, "seq"),
        ({"instance_id": "", "incarnation": 1, "seq": 2, "event_type": "pin"}, "instance_id"),
        ({"instance_id": "a", "incarnation": -1, "seq": 2, "event_type": "pin"}, "incarnation"),
    ],
)
def test_a_malformed_batch_fails_the_whole_body_with_a_reason(
    batch: dict[str, Any], reason: str
) -> None:
    """Next to a batch of an unknown type (the tolerant path) and without one."""
    future = {"instance_id": "mp-1", "incarnation": 1, "seq": 3, "event_type": "pin"}
    for batches in (
        (lmcache_batch(1, "config"), batch, future),
        (lmcache_batch(1, "config"), batch),
    ):
        with pytest.raises(InvalidInput, match=reason):
            decode_events(body(*batches), JSON, 100)


def test_kafka_records_lmcache_envelopes_bare_batches_and_unknown_types() -> None:
    config = lmcache_batch(1, "config", capacity_bytes=5, capacity_revision=1)
    [c] = decode_record(body(config), 100)  # type: ignore[misc]
    assert isinstance(c, EventBatch) and c.capacity_bytes == 5
    unknown = {"instance_id": "mp-1", "incarnation": 1, "seq": 2, "event_type": "pin"}
    assert decode_record(msgspec.json.encode(unknown), 100) == [
        UnknownBatch(InstanceId("mp-1"), Incarnation(1), 2, "pin")
    ]
    assert decode_record(msgspec.msgpack.encode(unknown), 100) == [
        UnknownBatch(InstanceId("mp-1"), Incarnation(1), 2, "pin")
    ]
    assert decode_record(body(config, unknown), 100) == [
        c,
        UnknownBatch(InstanceId("mp-1"), Incarnation(1), 2, "pin"),
    ]
    with pytest.raises(InvalidInput, match="carries no entries"):
        decode_record(body(lmcache_batch(1, "config", entries=[{"key": KEY}]), unknown), 100)
    with pytest.raises(InvalidInput, match="undecodable record"):
        decode_record(b'{"instance_id": "a", "seq": 1}', 100)
