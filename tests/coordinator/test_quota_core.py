"""The pure core of quotas, pins and the L2 usage book (`core.quotas`, `core.salt_usage`):
LMCache 0.5.6's semantics, checked against a simple model under hypothesis."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.core.coordinator.quotas import (
    DeleteQuota,
    DropPins,
    OperatorCapture,
    OperatorState,
    Pin,
    PinChunks,
    SetDefaultQuota,
    SetQuota,
    Unpin,
)
from kvatlas.core.coordinator.salt_usage import (
    SaltUsage,
    UsageCapture,
    delete_targets,
    eviction_plan,
)
from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import ObjectKey, pack_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier


def k(i: int, salt: str = "a", group: int = 0) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 1, group, salt)


def ev(
    event: EventType,
    keys: list[ObjectKey],
    *,
    iid: str = "s1",
    size: int = 100,
    tier: Tier = Tier.L2,
    shared: bool = False,
    backend: str = "fs",
) -> EventBatch:
    return EventBatch(
        InstanceId(iid),
        Incarnation(1),
        1,
        event,
        tier,
        tuple(Entry(key, size) for key in keys),
        backend=backend,
        shared=shared,
    )


def test_quota_ops_and_default() -> None:
    s = OperatorState()
    assert s.effective_limit("a") is None  # exempt until a default is set
    s.apply(SetDefaultQuota(0))
    assert s.effective_limit("a") == 0
    s.apply(SetQuota("a", 500))
    assert s.effective_limit("a") == 500
    assert s.apply(DeleteQuota("a")).found
    assert not s.apply(DeleteQuota("a")).found
    assert s.effective_limit("a") == 0


def test_pins_count_fold_groups_and_drop() -> None:
    s = OperatorState()
    s.apply(Pin((k(1), k(2))))
    s.apply(Pin((k(1, group=3),)))  # the same chunk in another group: one pin more
    assert s.pin_page("", "", 0, 10)[0] == 2
    counts = {p.key: p.pin_count for p in s.pin_page("", "", 0, 10)[1]}
    assert counts == {k(1): 2, k(2): 1}
    assert s.is_pinned(k(2, group=7))
    s.apply(Unpin((k(1),)))
    s.apply(Unpin((k(2),)))
    s.apply(Unpin((k(2),)))  # floored at 0
    assert {p.key: p.pin_count for p in s.pin_page("", "", 0, 10)[1]} == {k(1): 1}
    assert s.unpinned([k(1), k(2)]) == [k(2)]
    s.apply(DropPins((k(1, group=1),)))
    assert s.pinned_keys == 0


def test_pin_page_filters_and_order() -> None:
    s = OperatorState()
    s.apply(Pin((k(3, "b"), k(1, "a"), k(2, "b"))))
    total, page = s.pin_page("b", "", 0, 1)
    assert total == 2 and [p.key for p in page] == [k(3, "b")]
    assert s.pin_page("", "other-model", 0, 10) == (0, [])
    assert [p.key for p in s.pin_page("", "", 1, 10)[1]] == [k(1, "a"), k(2, "b")]


def test_log_positions_make_replay_a_no_op() -> None:
    s = OperatorState()
    assert not s.apply(Pin((k(1),)), ("kafka:t:0", 5)).skipped
    assert s.apply(Pin((k(1),)), ("kafka:t:0", 5)).skipped
    assert s.apply(Pin((k(1),)), ("kafka:t:0", 3)).skipped
    assert {p.key: p.pin_count for p in s.pin_page("", "", 0, 9)[1]} == {k(1): 1}
    restored = OperatorState.restore(
        msgspec.msgpack.decode(msgspec.msgpack.encode(s.capture()), type=OperatorCapture)
    )
    assert restored.apply(Pin((k(1),)), ("kafka:t:0", 5)).skipped
    assert restored.capture() == s.capture()


def test_usage_counts_every_copy_and_forgets_a_key_with_its_last() -> None:
    u = SaltUsage()
    u.apply(ev(EventType.STORE, [k(1), k(2)], iid="s1"))
    u.apply(ev(EventType.STORE, [k(1)], iid="s2"))
    u.apply(ev(EventType.STORE, [k(1)], iid="s2", size=150))  # re-store: the delta
    assert u.salt_bytes("a") == 350 and len(u) == 2
    u.apply(ev(EventType.DELETE, [k(1)], iid="s1"))
    assert u.salt_bytes("a") == 250 and u.keys_of("a") == [k(2), k(1)]
    u.apply(ev(EventType.DELETE, [k(1)], iid="s2"))
    assert u.keys_of("a") == [k(2)] and u.salt_bytes("a") == 100
    u.apply(ev(EventType.STORE, [k(3)], tier=Tier.L1))  # L1 is not the book's
    u.apply(ev(EventType.DELETE, [k(9)]))  # absent: a no-op
    assert u.bytes_by_salt() == {"a": 100} and u.total_bytes == 100


def test_plan_lru_first_pins_never_ratio_and_zero_limit() -> None:
    u = SaltUsage()
    u.apply(ev(EventType.STORE, [k(i) for i in range(10)]))
    u.apply(ev(EventType.ACCESS, [k(0)]))  # 0 becomes the most recent
    ops = OperatorState()
    assert eviction_plan(u, ops, 0.2, 1.0) == []  # no quota, no default: exempt
    ops.apply(SetQuota("a", 2000))
    assert eviction_plan(u, ops, 0.2, 1.0) == []  # 1000 bytes under 2000
    ops.apply(SetQuota("a", 1000))  # at the limit (watermark 1.0): evict
    ops.apply(Pin((k(1),)))
    (plan,) = eviction_plan(u, ops, 0.2, 1.0)
    assert plan.keys == [k(2), k(3)] and plan.evict_bytes == 200
    assert plan.usage_bytes == 1000 and plan.limit_bytes == 1000
    ops.apply(SetQuota("a", 0))  # a zero quota evicts every unpinned key
    (plan,) = eviction_plan(u, ops, 0.2, 1.0)
    assert plan.keys == [k(i) for i in (2, 3, 4, 5, 6, 7, 8, 9, 0)]
    ops.apply(SetQuota("a", 100_000))
    assert eviction_plan(u, ops, 0.2, 0.01) != []  # watermark: 1% of the limit


def test_plan_takes_at_least_one_key() -> None:
    u = SaltUsage()
    u.apply(ev(EventType.STORE, [k(1), k(2)]))
    ops = OperatorState()
    ops.apply(SetDefaultQuota(1))
    (plan,) = eviction_plan(u, ops, 0.1, 1.0)
    assert plan.keys == [k(1)]


def test_delete_targets_owner_or_one_live_server_for_shared() -> None:
    u = SaltUsage()
    u.apply(ev(EventType.STORE, [k(1)], iid="s1"))
    u.apply(ev(EventType.STORE, [k(2)], iid="s2"))
    u.apply(ev(EventType.STORE, [k(3)], iid="s2", shared=True))
    u.apply(ev(EventType.STORE, [k(4)], iid="gone"))
    targets, orphans = delete_targets(
        u, [k(1), k(2), k(3), k(4)], [InstanceId("s2"), InstanceId("s1")]
    )
    assert targets == {"s1": [k(1), k(3)], "s2": [k(2)]}
    assert orphans == 1


def test_usage_capture_restores_bytes_and_order() -> None:
    u = SaltUsage()
    u.apply(ev(EventType.STORE, [k(1), k(2), k(3, "b")]))
    u.apply(ev(EventType.STORE, [k(1)], iid="s2", shared=True))
    u.apply(ev(EventType.ACCESS, [k(1)]))
    data = msgspec.msgpack.encode(u.capture())
    r = SaltUsage.restore(msgspec.msgpack.decode(data, type=UsageCapture))
    assert r.bytes_by_salt() == u.bytes_by_salt() and r.total_bytes == u.total_bytes
    assert r.keys_of("a") == u.keys_of("a") == [k(2), k(1)]
    assert sorted(r.holders(k(1)), key=str) == sorted(u.holders(k(1)), key=str)


_events = st.lists(
    st.tuples(
        st.sampled_from([EventType.STORE, EventType.DELETE, EventType.ACCESS]),
        st.integers(0, 5),  # key
        st.sampled_from(["a", "b"]),
        st.sampled_from(["s1", "s2"]),
        st.booleans(),  # shared
        st.integers(1, 1000),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_events)
def test_usage_equals_a_simple_model(
    events: list[tuple[EventType, int, str, str, bool, int]],
) -> None:
    """Bytes per salt are the sum over live (key, holder) sizes; a salt's order holds
    exactly its keys with a copy, most recently stored or accessed last."""
    u = SaltUsage()
    sizes: dict[tuple[ObjectKey, str], int] = {}
    recency: dict[ObjectKey, int] = {}
    for t, (event, i, salt, iid, shared, size) in enumerate(events):
        key = k(i, salt)
        holder = "" if shared else iid
        u.apply(ev(event, [key], iid=iid, size=size, shared=shared))
        if event is EventType.STORE:
            sizes[(key, holder)] = size
            recency[key] = t
        elif event is EventType.DELETE:
            sizes.pop((key, holder), None)
            if not any(kk == key for kk, _ in sizes):
                recency.pop(key, None)
        elif key in recency:
            recency[key] = t
    for salt in ("a", "b"):
        want = sum(n for (kk, _), n in sizes.items() if kk.cache_salt == salt)
        assert u.salt_bytes(salt) == want
        order = sorted((t, kk) for kk, t in recency.items() if kk.cache_salt == salt)
        assert u.keys_of(salt) == [kk for _, kk in order]
    assert u.total_bytes == sum(sizes.values())


def test_keys_nobody_live_can_delete_are_passed_over() -> None:
    u = SaltUsage()
    u.apply(ev(EventType.STORE, [k(1), k(2)], iid="gone"))
    u.apply(ev(EventType.STORE, [k(3), k(4)], iid="s1"))
    ops = OperatorState()
    ops.apply(SetQuota("a", 0))
    u.apply(ev(EventType.STORE, [k(6)], iid="gone", shared=True))  # any live server
    (plan,) = eviction_plan(u, ops, 0.5, 1.0, {"s1"})
    assert plan.keys == [k(3), k(4), k(6)]  # a full sweep (limit 0), without the orphans
    assert plan.evict_bytes == 300
    assert eviction_plan(u, ops, 0.5, 1.0, set()) == []


def test_forget_owner_drops_its_private_copies_only() -> None:
    u = SaltUsage()
    u.apply(ev(EventType.STORE, [k(1), k(2)], iid="gone"))
    u.apply(ev(EventType.STORE, [k(2)], iid="s1"))
    u.apply(ev(EventType.STORE, [k(5)], iid="gone", shared=True))
    assert u.forget_owner("gone") == 2
    assert u.keys_of("a") == [k(2), k(5)] and u.salt_bytes("a") == 200


def test_a_key_block_counts_as_its_entries() -> None:
    """The block form (one namespace, columns) and the entries form agree, re-stores and
    a second holder included."""
    keys = [k(i) for i in range(6)]
    by_entries, by_block = SaltUsage(), SaltUsage()
    for book, blocky in ((by_entries, False), (by_block, True)):
        for iid, ks, size, created in (
            ("s1", keys[:4], 100, 4),
            ("s1", keys[2:], 150, 2),  # two re-stores, two new
            ("s2", keys[:2], 70, 2),  # a second holder of two
        ):
            b = ev(EventType.STORE, ks, iid=iid, size=size)
            if blocky:
                block = KeyBlock.from_entries(b.entries)
                b = msgspec.structs.replace(b, entries=(), block=block)
            assert book.apply(b) == created
    assert by_block.capture() == by_entries.capture()
    assert by_block.salt_bytes("a") == 2 * 100 + 4 * 150 + 2 * 70 and len(by_block) == 6


def test_pin_chunks_expand_to_every_rank_and_fit_a_record() -> None:
    hashes = [bytes([i]) * 32 for i in range(3)]
    op = PinChunks("m", 2, "a", b"".join(hashes))
    ranks = [pack_kv_rank(2, r, 2, r) for r in range(2)]
    assert op.keys() == [ObjectKey(h, "m", r, 0, "a") for h in hashes for r in ranks]
    s = OperatorState()
    s.apply(op)
    s.apply(op)
    s.apply(PinChunks("m", 2, "a", hashes[0], unpin=True))
    counts = [p.pin_count for p in s.pin_page("", "", 0, 10)[1]]
    assert counts == [1, 1, 2, 2, 2, 2]
    # LMCache's most tokens (3,906 chunks) at world size 8: one small Kafka record.
    big = PinChunks("m", 8, "a", bytes(32) * 3906)
    assert len(msgspec.msgpack.encode(big)) < 130_000
    with pytest.raises(InvalidInput, match="32 bytes each"):
        PinChunks("m", 1, "a", b"x" * 33).keys()
