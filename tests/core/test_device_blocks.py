"""The device tier's pure parts: the index and one engine's seq state machine, without
sockets; a stateful property test checks the stream against a simple model (every
published batch applied once, in order, whatever the delivery)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.core.device_blocks import (
    BlockKey,
    Cleared,
    DeviceEvent,
    DeviceIndex,
    EngineId,
    EngineStream,
    Removed,
    Stored,
    block_key,
)
from kvatlas.core.errors import InvalidInput

E = EngineId("e")


def _k(*ns: int) -> tuple[BlockKey, ...]:
    return tuple(BlockKey(n) for n in ns)


def test_block_key_int_and_digest_agree() -> None:
    digest = bytes(range(32))
    assert block_key(digest) == block_key(int.from_bytes(digest, "big") & (2**64 - 1))
    assert block_key(-1) == 2**64 - 1
    for bad in (True, b"", 2**64, "ab", 1.5):
        with pytest.raises(InvalidInput):
            block_key(bad)  # type: ignore[arg-type]


def test_index_media_removal_and_clear() -> None:
    ix = DeviceIndex()
    ix.apply(E, [Stored(_k(1, 2, 3), "GPU", 16, True), Stored(_k(1, 2), "CPU", 16, False)])
    assert ix.leading(E, _k(1, 2, 3, 4)) == (3, 0b001)
    assert ix.leading(E, _k(1, 2)) == (2, 0b011)
    ix.apply(E, [Removed(_k(1), "GPU")])
    assert ix.leading(E, _k(1, 2)) == (2, 0b010)  # still on CPU
    ix.apply(E, [Removed(_k(1), "CPU")])
    assert ix.leading(E, _k(1, 2)) == (0, 0)
    ix.apply(E, [Cleared()])
    assert ix.count(E) == 0 and ix.block_size(E) == 16


def test_gap_waits_for_replay_then_applies_in_order() -> None:
    s = EngineStream()
    assert s.live(0, ()).apply == ((0, ()),)
    out = s.live(3, (Cleared(),))
    assert out.replay_from == 1 and out.apply == ()
    assert s.replayed(1, ()).apply == ((1, ()),)
    assert s.replayed(2, ()).apply == ((2, ()),)
    assert s.replayed(3, (Cleared(),)).apply == ((3, (Cleared(),)),)
    assert s.replay_done().apply == ()  # 3 came by replay; its live copy is not applied twice
    assert s.last == 3 and not s.replaying


def test_replay_short_of_the_gap_counts_it_lost() -> None:
    s = EngineStream()
    s.live(0, ())
    s.live(5, ())
    out = s.replay_done()
    assert out.apply == ((5, ()),) and out.lost == 4


def test_live_seq_backwards_is_a_restart() -> None:
    s = EngineStream()
    for i in range(4):
        s.live(i, ())
    out = s.live(1, ())
    assert out.restarted and out.replay_from == 0 and out.apply == ()
    assert s.replayed(0, (), 10).apply == ((0, ()),)
    assert s.replay_done().apply == ((1, ()),)


def test_replayed_seq_with_other_content_is_a_restart() -> None:
    s = EngineStream()
    for i in range(3):
        s.replayed(i, (), fingerprint=100 + i)
    assert s.replayed(1, (), fingerprint=101).duplicate
    out = s.replayed(0, (), fingerprint=999)
    assert out.restarted and out.apply == ((0, ()),) and s.last == 0


def test_pending_is_bounded() -> None:
    s = EngineStream(max_pending=2)
    s.live(0, ())
    s.live(2, ())
    s.live(3, ())
    assert s.live(4, ()).overflow == 1


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 30),
    dropped=st.sets(st.integers(0, 29)),
    data=st.data(),
)
def test_stream_applies_every_batch_once_in_order(
    n: int, dropped: set[int], data: st.DataObject
) -> None:
    """Batches 0..n-1, the live ones minus ``dropped``; replays answered from the full
    buffer at arbitrary points: everything applies exactly once, in seq order."""
    s = EngineStream()
    applied: list[int] = []
    requests: list[int] = []

    def take(out_apply: tuple[tuple[int, tuple[DeviceEvent, ...]], ...]) -> None:
        applied.extend(seq for seq, _ in out_apply)

    published = 0
    while published < n or requests:
        if requests and (published == n or data.draw(st.booleans())):
            start = requests.pop(0)
            for seq in range(start, published):
                take(s.replayed(seq, (), seq).apply)
            take(s.replay_done().apply)
            continue
        seq = published
        published += 1
        if seq in dropped:
            continue
        out = s.live(seq, (), seq)
        take(out.apply)
        if out.replay_from is not None:
            requests.append(out.replay_from)
    if s.last != n - 1:
        start = s.connect().replay_from
        assert start is not None
        for seq in range(start, n):
            take(s.replayed(seq, (), seq).apply)
        take(s.replay_done().apply)
    assert applied == list(range(n))


def test_hybrid_groups_hold_a_block_apart() -> None:
    """A hybrid model stores one block hash in its full-attention and sliding-window
    groups; the window's eviction leaves the full group's copy held."""
    ix = DeviceIndex()
    ix.apply(E, [Stored(_k(1, 2), "GPU", 16, True, 0), Stored(_k(1, 2), "GPU", 16, True, 1)])
    ix.apply(E, [Removed(_k(1), "GPU", 1)])
    assert ix.leading(E, _k(1, 2)) == (2, 0b001)
    ix.apply(E, [Removed(_k(1), "GPU", 0)])
    assert ix.leading(E, _k(1, 2)) == (0, 0)
