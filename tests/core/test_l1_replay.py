"""The L1 journal's replay and the pool's restore: what a warm restart keeps, holds and
drops, for well-formed, torn and inconsistent journals."""

from __future__ import annotations

import pytest

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1_replay import Record, RecordKind, encode, encode_many, replay
from kvatlas.core.server.l1pool import L1Pool, Refused, Reserved, SlotInfo
from kvatlas.core.types import EventType

ALIGN = 4096
CAP = 64 * ALIGN


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 0, cache_salt=salt)


def rec(
    kind: RecordKind, i: int, offset: int = 0, size: int = 0, sum_: int | None = None
) -> Record:
    return Record(kind, key(i), offset, size, sum_)


R, C, S, D = RecordKind.RESERVE, RecordKind.COMMIT, RecordKind.CHECKSUM, RecordKind.DROP


def test_last_state_of_each_key_survives() -> None:
    data = encode_many([
        rec(R, 1, 0, ALIGN), rec(C, 1, 0, 100, 11),
        rec(R, 2, ALIGN, 2 * ALIGN), rec(C, 2, ALIGN, 5000, None), rec(S, 2, sum_=22),
        rec(R, 3, 3 * ALIGN, ALIGN),  # never sealed
        rec(R, 4, 4 * ALIGN, ALIGN), rec(C, 4, 4 * ALIGN, 10, 44), rec(D, 4),  # evicted
        rec(R, 5, 5 * ALIGN, ALIGN), rec(D, 5),  # aborted
    ])  # fmt: skip
    out = replay(data, 0, ALIGN, CAP)
    assert [(k.key, k.offset, k.size, k.checksum) for k in out.kept] == [
        (key(1), 0, 100, 11),
        (key(2), ALIGN, 5000, 22),
    ]
    assert [(p.key, p.offset, p.reserved) for p in out.pending] == [(key(3), 3 * ALIGN, ALIGN)]
    assert (out.records, out.torn, out.overlapping) == (11, False, 0)


def test_a_torn_or_corrupt_tail_ends_the_replay() -> None:
    good = encode_many([rec(C, 1, 0, 100, 11)])
    late = encode(rec(C, 2, ALIGN, 100, 22))
    for tail in (late[:-1], late[:5], b"\x01"):
        out = replay(good + tail, 0, ALIGN, CAP)
        assert [k.key for k in out.kept] == [key(1)] and out.torn
    flipped = bytearray(good + late)
    flipped[-1] ^= 0xFF  # crc mismatch: the record is not trusted
    out = replay(bytes(flipped), 0, ALIGN, CAP)
    assert [k.key for k in out.kept] == [key(1)] and out.torn


@pytest.mark.parametrize(
    "bad", [rec(C, 2, 100, 10, 1), rec(C, 2, CAP - ALIGN, 2 * ALIGN, 1), rec(R, 2, -ALIGN, 10)]
)
def test_a_record_outside_the_pool_is_corrupt(bad: Record) -> None:
    out = replay(encode_many([rec(C, 1, 0, 10, 1), bad, rec(C, 3, ALIGN, 10, 3)]), 0, ALIGN, CAP)
    assert [k.key for k in out.kept] == [key(1)] and out.torn


def test_overlapping_survivors_keep_only_the_newest() -> None:
    data = encode_many([
        rec(C, 1, 0, 3 * ALIGN, 1),  # overlapped by 2 (its DROP lost)
        rec(C, 2, ALIGN, ALIGN, 2),
        rec(C, 3, 4 * ALIGN, ALIGN, 3),
    ])  # fmt: skip
    out = replay(data, 0, ALIGN, CAP)
    assert [k.key for k in out.kept] == [key(2), key(3)] and out.overlapping == 1


def slot(i: int, offset: int, size: int, committed: bool = True) -> SlotInfo:
    return SlotInfo(key(i), offset, size, 0, 100 + i, committed)


def test_restore_fills_an_empty_pool_and_holds_unsealed_ranges() -> None:
    pool = L1Pool(CAP, ALIGN)
    pool.restore(
        [slot(1, 0, 5000), slot(2, 2 * ALIGN, ALIGN, False), slot(3, 5 * ALIGN, 10)], 0.0, 30.0
    )
    assert pool.contains(key(1)) and pool.contains(key(3)) and not pool.contains(key(2))
    assert [(e.kind, e.key, e.reason) for e in pool.take_events()] == [
        (EventType.STORE, key(1), "restored"),
        (EventType.STORE, key(3), "restored"),
    ]
    assert pool.free_extents() == [(3 * ALIGN, 2 * ALIGN), (6 * ALIGN, CAP - 6 * ALIGN)]
    assert pool.acquire_read(key(1), "t", 0.0, 5.0).checksum == 101  # type: ignore[union-attr]
    assert isinstance(pool.reserve(key(2), 10, 0.0, 5.0), Refused)  # held: busy
    assert pool.commit(key(2), 1, 1.0) is None  # nobody may seal a held write
    assert [e.key for e in pool.expire(29.9) if e.write] == []  # held for the whole lease
    assert [e.key for e in pool.expire(30.0) if e.write] == [key(2)]
    assert isinstance(pool.reserve(key(2), 10, 31.0, 5.0), Reserved)


def test_restored_chunks_are_evicted_first_and_counted_per_salt() -> None:
    pool = L1Pool(4 * ALIGN, ALIGN)
    pool.restore([slot(1, 0, ALIGN), slot(2, ALIGN, ALIGN)], 0.0, 30.0)
    pool.take_events()
    for i in (3, 4, 5):
        got = pool.reserve(key(i), ALIGN, 0.0, 5.0)
        assert isinstance(got, Reserved)
        pool.commit(key(i), 0, 0.0)
    assert not pool.contains(key(1)) and pool.contains(key(2))
    assert sum(u.bytes for u in pool.salt_usage()) == 4 * ALIGN


@pytest.mark.parametrize(
    "slots",
    [
        [slot(1, 0, ALIGN + 1), slot(2, ALIGN, 10)],  # overlap
        [slot(1, 10, 10)],  # misaligned
        [slot(1, 0, CAP + 1)],  # past the end
        [slot(1, 0, 10), SlotInfo(key(1), ALIGN, 10, 0, 1, True)],  # the key twice
        [slot(2, ALIGN, 10), slot(1, 0, 10)],  # not by offset
    ],
)
def test_restore_refuses_inconsistent_slots_and_changes_nothing(slots: list[SlotInfo]) -> None:
    pool = L1Pool(CAP, ALIGN)
    with pytest.raises(InvalidInput):
        pool.restore(slots, 0.0, 30.0)
    assert len(pool) == 0 and pool.free_extents() == [(0, CAP)]


def test_restore_needs_an_empty_pool() -> None:
    pool = L1Pool(CAP, ALIGN)
    pool.reserve(key(9), 10, 0.0, 5.0)
    with pytest.raises(InvalidInput):
        pool.restore([slot(1, 8 * ALIGN, 10)], 0.0, 30.0)
