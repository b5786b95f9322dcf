"""The wire forms of event batches: the key block through `compact_batch`, the msgpack
body and Kafka record, the JSON form, and the validation of a block."""

from __future__ import annotations

import msgspec
import pytest

from kvatlas.core.errors import InvalidInput, TooLarge
from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import Namespace, chunk_hashes, default_kv_rank, object_keys
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.events_api import (
    check_batch,
    compact_batch,
    decode_events,
    encode_events_json,
    encode_events_msgpack,
)
from kvatlas.wire.http_api import MSGPACK_CONTENT_TYPE
from kvatlas.wire.kafka_records import decode_record, encode_batch_msgpack

NS = Namespace("m", default_kv_rank())
HASHES = chunk_hashes(list(range(4 * 8)), 4)
KEYS = object_keys(HASHES, NS)


def entries_batch(entries: tuple[Entry, ...], seq: int = 1) -> EventBatch:
    return EventBatch(
        InstanceId("node-a"),
        Incarnation(3),
        seq,
        EventType.STORE,
        Tier.L2,
        entries,
        "disk",
        True,
        1.5,
    )


def test_compact_batch_moves_equivalent_entries_into_a_block() -> None:
    b = entries_batch(tuple(Entry(k, 100 + i) for i, k in enumerate(KEYS)))
    c = compact_batch(b)
    assert c.entries == () and c.block is not None
    assert c.block == KeyBlock(NS, b"".join(HASHES), tuple(range(100, 108)))
    assert c.all_entries() == b.entries
    assert (c.instance_id, c.incarnation, c.seq, c.tier, c.backend, c.shared, c.ts) == (
        "node-a",
        3,
        1,
        Tier.L2,
        "disk",
        True,
        1.5,
    )
    assert compact_batch(c) is c
    with_tokens = entries_batch((Entry(KEYS[0], 1), Entry(KEYS[1], 1, (1, 2, 3, 4), 4)))
    assert compact_batch(with_tokens) is with_tokens
    empty = entries_batch(())
    assert compact_batch(empty) is empty


def test_block_batches_survive_every_encoding() -> None:
    b = entries_batch(tuple(Entry(k, 7) for k in KEYS))
    c = compact_batch(b)
    body = encode_events_msgpack([c, b])
    assert len(body) < len(encode_events_msgpack([b, b]))
    assert decode_events(body, MSGPACK_CONTENT_TYPE, 100) == [c, b]
    assert decode_record(encode_batch_msgpack(c), 100) == [c]
    # JSON has no block: the block's objects become entries, so the JSON is unchanged
    assert encode_events_json([c]) == encode_events_json([b])
    [back] = decode_events(encode_events_json([c]), "application/json", 100)
    assert back == b


def test_a_malformed_block_is_refused_with_a_reason() -> None:
    blob = b"".join(HASHES[:2])
    cases = [
        (KeyBlock(NS, blob + b"x", (1, 1)), "multiple of 32 bytes, got 65"),
        (KeyBlock(NS, blob, (1, 1, 1)), "2 hashes but 3 sizes"),
        (KeyBlock(NS, blob, (1, 1 << 40)), f"got {1 << 40} in a key block"),
        (KeyBlock(NS, blob, (1, -3)), "got -3 in a key block"),
    ]
    for block, reason in cases:
        b = EventBatch(
            InstanceId("node-a"), Incarnation(1), 9, EventType.DELETE, Tier.L1, (), block=block
        )
        with pytest.raises(InvalidInput, match=reason):
            check_batch(b, 100)
        with pytest.raises(InvalidInput, match=reason):
            decode_record(encode_batch_msgpack(b), 100)
        with pytest.raises(InvalidInput, match=reason):
            decode_events(encode_events_msgpack([b]), MSGPACK_CONTENT_TYPE, 100)
    ok = EventBatch(
        InstanceId("a"),
        Incarnation(1),
        1,
        EventType.STORE,
        Tier.L1,
        (Entry(KEYS[0], 1),),
        block=None,
    )
    check_batch(compact_batch(entries_batch(tuple(Entry(k, (1 << 40) - 1) for k in KEYS))), 8)
    check_batch(ok, 1)
    too_many = EventBatch(
        InstanceId("a"),
        Incarnation(1),
        1,
        EventType.STORE,
        Tier.L1,
        (Entry(KEYS[0], 1),),
        block=KeyBlock.of(NS, HASHES, 1),
    )
    with pytest.raises(TooLarge, match="has 9 entries, the limit is 8"):
        check_batch(too_many, 8)
    not_a_block = msgspec.msgpack.encode(
        {**msgspec.structs.asdict(ok), "block": {"namespace": NS, "hashes": "text", "sizes": []}}
    )
    with pytest.raises(InvalidInput, match="block"):
        decode_record(not_a_block, 100)


def test_compact_versions_one_and_two_are_read_and_others_refused() -> None:
    """Version 2 added blocks: a version 1 body (no block) still decodes; an unknown
    version is refused with a reason rather than read as something it may not be."""
    b = entries_batch(tuple(Entry(k, 7) for k in KEYS))
    for version in (1, 2):
        body = msgspec.msgpack.encode({"batches": [b], "version": version})
        assert decode_events(body, MSGPACK_CONTENT_TYPE, 100) == [b]
    body = msgspec.msgpack.encode({"batches": [b], "version": 3})
    with pytest.raises(InvalidInput, match="version 3"):
        decode_events(body, MSGPACK_CONTENT_TYPE, 100)
    assert msgspec.msgpack.decode(encode_events_msgpack([b]))["version"] == 2
