"""Event batches: the columnar key block, its equivalence with entries, and the msgpack
form with and without a block."""

from __future__ import annotations

import msgspec
import pytest

from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import Namespace, chunk_hashes, default_kv_rank, object_keys
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier

NS = Namespace("m", default_kv_rank(), 2, "salt")
HASHES = chunk_hashes(list(range(4 * 8)), 4)


def test_block_of_and_its_entries() -> None:
    block = KeyBlock.of(NS, HASHES[:3], [1, 2, 3])
    assert block.count == 3
    assert block.hashes == b"".join(HASHES[:3])
    assert block.hash_list() == HASHES[:3]
    assert block.entries() == tuple(
        Entry(k, s) for k, s in zip(object_keys(HASHES[:3], NS), [1, 2, 3], strict=True)
    )
    assert KeyBlock.of(NS, HASHES[:2], 7).sizes == (7, 7)
    assert KeyBlock.of(NS, [], 7).entries() == ()


def test_block_of_refuses_bad_columns() -> None:
    with pytest.raises(InvalidInput, match="32 bytes"):
        KeyBlock.of(NS, [HASHES[0], b"short"], 1)
    with pytest.raises(InvalidInput, match="2 sizes"):
        KeyBlock.of(NS, HASHES[:3], [1, 2])
    bad = KeyBlock(NS, b"x" * 33, (1,))
    with pytest.raises(InvalidInput, match="33 bytes of hashes for 1 sizes"):
        bad.check_shape()
    with pytest.raises(InvalidInput):
        bad.entries()


def test_from_entries_only_when_equivalent() -> None:
    keys = object_keys(HASHES[:4], NS)
    entries = tuple(Entry(k, 10 + i) for i, k in enumerate(keys))
    block = KeyBlock.from_entries(entries)
    assert block is not None and block.entries() == entries
    other_ns = object_keys(HASHES[:1], Namespace("m", default_kv_rank(), 2, "other"))[0]
    refused = [
        (),
        (*entries, Entry(keys[0], 1, (1, 2, 3, 4), 0)),  # tokens
        (*entries, Entry(keys[0], 1, None, 4)),  # a known offset without tokens
        (*entries, Entry(other_ns, 1)),  # a second namespace
        (*entries, Entry(msgspec.structs.replace(keys[0], chunk_hash=b"abc"), 1)),
    ]
    for es in refused:
        assert KeyBlock.from_entries(es) is None


def test_batch_counts_and_all_entries_are_entries_then_block() -> None:
    head = (Entry(object_keys(HASHES[5:6], NS)[0], 5),)
    block = KeyBlock.of(NS, HASHES[:3], 1)
    b = EventBatch(InstanceId("a"), Incarnation(1), 1, EventType.STORE, Tier.L1, head, block=block)
    assert b.n_entries == 4
    assert b.all_entries() == head + block.entries()
    plain = EventBatch(InstanceId("a"), Incarnation(1), 1, EventType.STORE, Tier.L1, head)
    assert plain.n_entries == 1 and plain.all_entries() is head


def test_msgpack_with_and_without_block() -> None:
    block = KeyBlock.of(NS, HASHES[:3], [1, 2, 3])
    b = EventBatch(InstanceId("a"), Incarnation(1), 1, EventType.STORE, Tier.L1, (), block=block)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(b), type=EventBatch) == b
    # A body from an emitter that predates blocks: no "block" field at all.
    old = msgspec.structs.asdict(
        EventBatch(InstanceId("a"), Incarnation(1), 2, EventType.DELETE, Tier.L2, ())
    )
    del old["block"]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=EventBatch)
    assert decoded.block is None and decoded.seq == 2 and decoded.n_entries == 0
