"""The version rule (`wire.versions`) and what the one-way wires do with a newer writer.

A Kafka batch record of a version this coordinator does not read is read as far as the
gate needs and skipped like an unknown event type (``store@v2``); a membership record of
a newer format or type is an `UnknownRecord` to skip. An HTTP body of a newer compact
version is refused whole with the versions read, since its sender hears of it at once.
"""

from __future__ import annotations

import msgspec
import pytest

from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import Entry, EventBatch, UnknownBatch
from kvatlas.core.keys import ObjectKey
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.events_api import COMPACT_VERSIONS, decode_events
from kvatlas.wire.http_api import MSGPACK_CONTENT_TYPE
from kvatlas.wire.kafka_records import (
    MAGIC,
    RECORD_VERSION,
    HeartbeatRecord,
    UnknownRecord,
    decode_record,
    encode_batch_msgpack,
    encode_membership,
)
from kvatlas.wire.versions import FIRST_RELEASE, VersionRange, highest_common, peer_range

KEY = ObjectKey(b"\x01" * 32, "m", 0)
BATCH = EventBatch(
    InstanceId("node-a"), Incarnation(4), 7, EventType.STORE, Tier.L1, (Entry(KEY, 9),)
)


def test_version_ranges() -> None:
    assert VersionRange.upto(1) == VersionRange(1, 1) == FIRST_RELEASE
    assert VersionRange.upto(5) == VersionRange(4, 5) and str(VersionRange(4, 5)) == "4..5"
    assert peer_range(0, 0) == FIRST_RELEASE  # a first-release peer names no range
    assert peer_range(2, 3) == VersionRange(2, 3)
    assert highest_common(VersionRange(1, 2), VersionRange(2, 3)) == 2
    assert highest_common(VersionRange(1, 2), FIRST_RELEASE) == 1
    assert highest_common(VersionRange(2, 3), FIRST_RELEASE) is None  # two releases apart


def record(**changes: object) -> bytes:
    raw = msgspec.msgpack.decode(encode_batch_msgpack(BATCH))
    raw.update(changes)
    return msgspec.msgpack.encode(raw)


def test_a_batch_record_carries_its_version_and_a_newer_one_is_skipped() -> None:
    assert msgspec.msgpack.decode(encode_batch_msgpack(BATCH))["v"] == RECORD_VERSION
    assert decode_record(encode_batch_msgpack(BATCH), 10) == [BATCH]
    newer = RECORD_VERSION + 1
    # well formed in the newer version (a field of a shape this one would refuse): skipped
    got = decode_record(record(v=newer, tier="l9", entries="anything"), 10)
    assert got == [UnknownBatch(InstanceId("node-a"), Incarnation(4), 7, f"store@v{newer}")]
    # without the gate's fields it is not well formed: refused as before
    with pytest.raises(InvalidInput, match="undecodable"):
        decode_record(msgspec.msgpack.encode({"v": newer, "event_type": "store"}), 10)
    # JSON bare batches too
    head = {"instance_id": "a", "incarnation": 1, "seq": 2, "event_type": "store", "v": newer}
    assert decode_record(msgspec.json.encode(head), 10) == [
        UnknownBatch(InstanceId("a"), Incarnation(1), 2, f"store@v{newer}")
    ]


def test_newer_membership_formats_and_types_are_unknown_records() -> None:
    beat = HeartbeatRecord(InstanceId("node-a"), 1.0)
    assert decode_record(encode_membership(beat), 10) == beat
    assert decode_record(b"KVM2" + msgspec.msgpack.encode({"anything": 1}), 10) == UnknownRecord(
        "membership@v2"
    )
    future = MAGIC + msgspec.msgpack.encode({"type": "lease_transfer", "at": 1.0})
    assert decode_record(future, 10) == UnknownRecord("membership:lease_transfer")
    # a known type that is malformed is still refused, not skipped
    with pytest.raises(InvalidInput, match="undecodable"):
        decode_record(MAGIC + msgspec.msgpack.encode({"type": "heartbeat", "at": "x"}), 10)


def test_a_newer_compact_body_is_refused_naming_the_versions_read() -> None:
    body = msgspec.msgpack.encode({"batches": [BATCH], "version": COMPACT_VERSIONS.hi + 1})
    with pytest.raises(InvalidInput, match=f"reads {COMPACT_VERSIONS.lo}..{COMPACT_VERSIONS.hi}"):
        decode_events(body, MSGPACK_CONTENT_TYPE, 10)
    body = msgspec.msgpack.encode({"batches": [BATCH], "version": COMPACT_VERSIONS.lo})
    assert decode_events(body, MSGPACK_CONTENT_TYPE, 10) == [BATCH]
