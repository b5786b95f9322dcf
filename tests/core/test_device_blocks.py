"""The device tier's pure parts: the index and one engine's seq state machine, without
sockets; a stateful property test checks the stream against a simple model (every
published batch applied once, in order, whatever the delivery)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.core.coordinator.block_table import DYNAMO_SEED, extra_hash, local_hashes, prompt_keys
from kvatlas.core.coordinator.engine_stream import EngineStream, Outcome
from kvatlas.core.device_blocks import (
    BlockKey,
    Cleared,
    DeviceEvent,
    DeviceIndex,
    EngineId,
    Removed,
    Stored,
    block_key,
)
from kvatlas.core.errors import InvalidInput

E = EngineId("e")


def _k(*ns: int) -> tuple[BlockKey, ...]:
    return tuple(BlockKey(n) for n in ns)


B = 4


def _t(*ns: int) -> list[int]:
    """The tokens of blocks named by ``ns`` (block n is n repeated)."""
    return [n for n in ns for _ in range(B)]


def _keys(*ns: int, salt: str | None = None) -> bytes:
    return prompt_keys(_t(*ns), B, cache_salt=salt)


def test_block_key_int_and_digest_agree() -> None:
    digest = bytes(range(32))
    assert block_key(digest) == block_key(int.from_bytes(digest, "big") & (2**64 - 1))
    assert block_key(-1) == 2**64 - 1
    for bad in (True, b"", 2**64, "ab", 1.5):
        with pytest.raises(InvalidInput):
            block_key(bad)  # type: ignore[arg-type]


def test_index_media_removal_and_clear() -> None:
    ix = DeviceIndex()
    gpu = Stored(_k(1, 2, 3), "GPU", B, True, tokens=_t(1, 2, 3))
    ix.apply(E, [gpu, Stored(_k(1, 2), "CPU", B, False)])  # CPU: no tokens, the GPU copy's
    assert ix.leading(E, _keys(1, 2, 3, 4)) == (3, 0b001)
    assert ix.leading(E, _keys(1, 2)) == (2, 0b001)  # read from the GPU, the first tier
    ix.apply(E, [Removed(_k(1), "GPU")])
    assert ix.leading(E, _keys(1, 2)) == (2, 0b010)  # still on CPU
    ix.apply(E, [Removed(_k(1), "CPU")])
    assert ix.leading(E, _keys(1, 2)) == (0, 0)
    ix.apply(E, [Cleared()])
    assert ix.count(E) == 0 and ix.block_size(E) == B


def test_tiers_are_read_in_vllms_order() -> None:
    """GPU's leading run, then the CPU blocks after it, then storage's: a GPU block after
    a CPU-only one does not count (vLLM's offloading loads from where the GPU hit ends,
    and the block after is recomputed)."""
    ix = DeviceIndex()
    ix.apply(E, [Stored(_k(1, 2, 3, 4), "GPU", B, True, tokens=_t(1, 2, 3, 4))])
    ix.apply(E, [Stored(_k(2, 3), "CPU", B, False), Stored(_k(3, 4), "STORAGE", B, False)])
    ix.apply(E, [Removed(_k(2, 3), "GPU")])
    # GPU {1, 4}, CPU {2, 3}, STORAGE {3, 4}: 1 from GPU, 2-3 from CPU, 4 from storage.
    assert ix.tiers(E, _keys(1, 2, 3, 4)) == ((1, 2, 1), 0b111)
    ix.apply(E, [Removed(_k(4), "STORAGE")])
    assert ix.tiers(E, _keys(1, 2, 3, 4)) == ((1, 2, 0), 0b011)  # block 4 on GPU: recomputed
    assert ix.leading(E, _keys(2, 3)) == (0, 0)


def test_a_store_chains_onto_its_parent_in_any_engine() -> None:
    """Later blocks of a prompt come in their own store, naming their parent: their
    content keys continue its chain, whichever engine holds the parent. A store whose
    parent no engine holds is kept (removals find it) but never matched."""
    ix = DeviceIndex()
    ix.apply(E, [Stored(_k(1, 2), "GPU", B, True, tokens=_t(1, 2))])
    ix.apply(E, [Stored(_k(3), "GPU", B, True, parent=BlockKey(2), tokens=_t(3))])
    assert ix.leading(E, _keys(1, 2, 3)) == (3, 0b001)
    assert ix.leading(E, _keys(3)) == (0, 0)  # block 3's tokens alone are another prompt
    other = EngineId("f")
    ix.apply(other, [Stored(_k(3), "CPU", B, True, parent=BlockKey(2), tokens=_t(3))])
    assert ix.leading(other, _keys(1, 2, 3)) == (0, 0)  # it holds block 3, not 1 and 2
    assert ix.masks(other, _keys(1, 2, 3)) == [0, 0, 0b010] and ix.unchained(other) == 0
    ix.apply(other, [Stored(_k(9), "GPU", B, True, parent=BlockKey(8), tokens=_t(9))])
    assert ix.unchained(other) == 1 and ix.count(other) == 2
    ix.apply(other, [Removed(_k(9), "GPU")])
    assert ix.count(other) == 1


def test_a_salted_block_matches_its_salt_only() -> None:
    """vLLM publishes the cache salt in the first block's extra keys: the chain carries
    it, so the blocks answer a prompt of the same salt and nothing else."""
    ix = DeviceIndex()
    salted = Stored(
        _k(1, 2), "GPU", B, True, tokens=_t(1, 2), extras=(extra_hash(("tenant-x",)), 0)
    )
    ix.apply(E, [salted])
    assert ix.leading(E, _keys(1, 2, salt="tenant-x"))[0] == 2
    assert ix.leading(E, _keys(1, 2))[0] == 0
    assert ix.leading(E, _keys(1, 2, salt="tenant-y"))[0] == 0


def test_dump_names_each_block_with_its_local_hash_and_parent() -> None:
    ix = DeviceIndex()
    ix.apply(E, [Stored(_k(1, 2), "GPU", B, True, tokens=_t(1, 2))])
    dumped = {d.block_hash: d for d in ix.dump(E)}
    locals_ = local_hashes(_t(1, 2), B, DYNAMO_SEED)
    assert dumped[1].parent_hash is None and dumped[2].parent_hash == 1
    assert dumped[1].tokens_hash == int.from_bytes(locals_[:8], "little")
    assert dumped[2].tokens_hash == int.from_bytes(locals_[8:], "little")
    assert dumped[2].media == ("GPU",)


def test_gap_waits_for_replay_then_applies_in_order() -> None:
    s = EngineStream()
    assert s.live(0, ()).apply == ((0, ()),)
    out = s.live(3, (Cleared(),))
    # from the last applied seq, not past it: its batch again shows a restart behind the gap
    assert out.replay_from == 0 and out.apply == ()
    assert s.replayed(0, ()).apply == ()  # the same batch 0: nothing to apply again
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


@pytest.mark.slow  # 200 examples: 10 to 13 s measured on the 2-core VM
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

    def ask(start: int | None) -> None:
        if start is not None:
            s.replay_sent()
            requests.append(start)

    published = 0
    while published < n or requests:
        if requests and (published == n or data.draw(st.booleans())):
            start = requests.pop(0)  # one DEALER: answered in the order asked
            for seq in range(start, published):
                take(s.replayed(seq, (), seq).apply)
            take(s.replay_end().apply)
            continue
        if published and data.draw(st.integers(0, 4)) == 0:
            ask(s.connect().replay_from)  # an idle check, maybe while a replay runs
            continue
        seq = published
        published += 1
        if seq in dropped:
            continue
        out = s.live(seq, (), seq)
        take(out.apply)
        ask(out.replay_from)
    if s.last != n - 1:
        first = s.connect().replay_from
        assert first is not None
        s.replay_sent()
        for seq in range(first, n):
            take(s.replayed(seq, (), seq).apply)
        take(s.replay_end().apply)
    assert applied == list(range(n))
    assert not s.replaying


def test_an_earlier_requests_end_does_not_end_a_later_replay() -> None:
    """The interleaving that lost a restarted publisher's first batch: an idle check's
    request reached the new publisher, the subscriber reconnected (a full replay asked)
    and saw the new seq 1 live (seq 0 went out before its subscription took); the idle
    check's answer, only an end marker, ended the replay, so seq 1 applied at once and
    the full replay's seq 0 then came as a "duplicate" of it."""
    s = EngineStream()
    for seq in range(6):
        s.live(seq, (), 100 + seq)  # the first publisher
    assert s.connect().replay_from == 5
    s.replay_sent()
    assert s.reconnected().replay_from == 0
    s.replay_sent()
    out = s.live(1, (), 201)  # the new publisher's seq 1: seqs began again
    assert out.restarted and out.replay_from == 0
    s.replay_sent()
    assert s.replay_end() == Outcome()  # the idle check's answer: nothing at or after 5
    assert s.replaying and s.last is None
    assert s.replayed(0, (), 200).apply == ((0, ()),)
    assert s.replayed(1, (), 201).apply == ((1, ()),)
    assert s.replay_end() == Outcome()  # the reconnection's; the restart's still comes
    assert s.replayed(0, (), 200).duplicate and s.replayed(1, (), 201).duplicate
    assert s.replay_end() == Outcome(apply=())
    assert not s.replaying and s.last == 1


def test_an_end_no_request_awaits_changes_nothing() -> None:
    s = EngineStream()
    s.live(0, ())
    assert s.live(2, ()).replay_from == 0  # not sent yet (the replay socket is down)
    assert s.replay_end() == Outcome()  # a late answer to a request given up on
    assert s.replaying and s.last == 0
    assert s.replay_done().apply == ((2, ()),)  # the shell gives up: what waited applies


def test_idle_check_sees_its_seq_again_or_a_restart_behind_it() -> None:
    s = EngineStream()
    for seq in range(4):
        s.live(seq, (), 10 + seq)
    assert s.connect().replay_from == 3
    s.replay_sent()
    assert s.replayed(3, (), 13) == Outcome()  # the same publisher: not a duplicate
    assert s.replay_end() == Outcome(apply=())
    # The publisher restarts with two batches the subscriber missed: its answer to the
    # next check has nothing at or after seq 3.
    assert s.connect().replay_from == 3
    s.replay_sent()
    out = s.replay_end()
    assert out.restarted and out.replay_from == 0 and s.last is None
    s.replay_sent()
    assert s.replayed(0, (), 20).apply == ((0, ()),)
    assert s.replayed(1, (), 21).apply == ((1, ()),)
    assert s.replay_end() == Outcome(apply=())
    assert not s.replaying and s.last == 1
    # A check the publisher answers past its seq (its buffer rolled on): the gap is lost.
    assert s.connect().replay_from == 1
    s.replay_sent()
    assert s.replayed(5, (), 25) == Outcome(apply=((5, ()),), lost=3)


def test_hybrid_groups_hold_a_block_apart() -> None:
    """A hybrid model stores one block hash in its full-attention and sliding-window
    groups; the window's eviction of an early block leaves the hit (the window needs only
    the last block), the full group's eviction ends it."""
    ix = DeviceIndex()
    window = Stored(_k(1, 2), "GPU", B, True, 1, kind="sliding_window", window=B, tokens=_t(1, 2))
    ix.apply(E, [Stored(_k(1, 2), "GPU", B, True, 0, tokens=_t(1, 2)), window])
    ix.apply(E, [Removed(_k(1), "GPU", 1)])
    assert ix.leading(E, _keys(1, 2)) == (2, 0b001)
    ix.apply(E, [Removed(_k(1), "GPU", 0)])
    assert ix.leading(E, _keys(1, 2)) == (0, 0)
