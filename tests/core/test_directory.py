"""Key directory: upserts, lookups by keys and by prefix, fencing, stats, snapshots."""

from __future__ import annotations

import gc
import types

import msgspec
import pytest

from kvatlas.core.coordinator.directory import KeyDirectory
from kvatlas.core.errors import InvalidInput, SnapshotError
from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import Namespace, ObjectKey, chunk_hashes, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier

NS = Namespace("m", default_kv_rank())
HASHES = chunk_hashes(list(range(256 * 6)))


def key(i: int, ns: Namespace = NS) -> ObjectKey:
    return ObjectKey(HASHES[i], ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt)


def batch(
    iid: str,
    kind: EventType,
    idx: list[int],
    tier: Tier = Tier.L1,
    inc: int = 1,
    size: int = 100,
    ns: Namespace = NS,
) -> EventBatch:
    return EventBatch(
        InstanceId(iid),
        Incarnation(inc),
        1,
        kind,
        tier,
        tuple(Entry(key(i, ns), size) for i in idx),
    )


def test_store_is_an_upsert_and_access_never_creates() -> None:
    d = KeyDirectory()
    assert d.apply(batch("a", EventType.STORE, [0, 1])).created == 2
    assert d.apply(batch("a", EventType.STORE, [0], size=300)).created == 0
    assert d.apply(batch("a", EventType.ACCESS, [0, 5])).ignored == 1
    [r0, r5] = d.lookup_keys([key(0), key(5)])
    assert [p.size_bytes for p in r0.placements] == [300]
    assert r0.access_count == 1
    assert r5.placements == ()
    assert d.stats().bytes == 400


def test_delete_of_absent_is_a_noop_and_only_removes_own_placement() -> None:
    d = KeyDirectory()
    d.apply(batch("a", EventType.STORE, [0]))
    d.apply(batch("b", EventType.STORE, [0]))
    assert d.apply(batch("c", EventType.DELETE, [0, 3])).created == 0
    d.apply(batch("a", EventType.DELETE, [0]))
    [r] = d.lookup_keys([key(0)])
    assert [p.instance_id for p in r.placements] == ["b"]


def test_prefix_lookup_reports_longest_prefix_per_instance_and_tier() -> None:
    d = KeyDirectory()
    d.apply(batch("a", EventType.STORE, [0, 1, 2, 3]))
    d.apply(batch("b", EventType.STORE, [0, 1]))
    d.apply(batch("b", EventType.STORE, [0, 1, 2], tier=Tier.L2))
    d.apply(batch("c", EventType.STORE, [1, 2, 3]))  # no first chunk: no prefix
    res = d.lookup_prefix(HASHES[:5], NS)
    holders = [(h.instance_id, h.tier, h.chunks) for h in res.holders]
    assert holders == [("a", Tier.L1, 4), ("b", Tier.L2, 3), ("b", Tier.L1, 2)]
    assert [len(p) for p in res.placements] == [3, 4, 3, 2, 0]
    assert [r.key for r in res.results()] == [key(i) for i in range(5)]


def test_blob_lookup_matches_key_lookup() -> None:
    """The keys form's columnar lookup (one blob of hashes, in any order, repeats and
    unknown hashes included) says what `lookup_keys` says, access counts too."""
    d = KeyDirectory()
    d.apply(batch("a", EventType.STORE, [0, 1, 2]))
    d.apply(batch("b", EventType.STORE, [1], tier=Tier.L2))
    d.apply(batch("a", EventType.ACCESS, [1, 1]))
    order = [2, 5, 1, 1, 0]
    cols = d.lookup_blob(b"".join(HASHES[i] for i in order), NS)
    by_key = d.lookup_keys([key(i) for i in order])
    assert list(cols.placements) == [r.placements for r in by_key]
    assert list(cols.access_counts) == [r.access_count for r in by_key] == [0, 0, 2, 2, 0]
    other = d.lookup_blob(HASHES[0], Namespace("unknown", 1))
    assert other.placements == ((),)
    with pytest.raises(InvalidInput, match="multiple of 32"):
        d.lookup_blob(b"x" * 33, NS)


def test_capture_is_the_state_at_capture_time() -> None:
    """A snapshot encoded from a capture after more changes (what the coordinator does
    outside its lock) restores the directory as it was when captured."""
    d = KeyDirectory()
    d.apply(batch("a", EventType.STORE, [0, 1, 2]))
    d.apply(batch("b", EventType.STORE, [1], tier=Tier.L2))
    d.apply(batch("a", EventType.ACCESS, [1]))
    expected = d.digest()
    cap = d.capture()
    d.apply(batch("a", EventType.STORE, [3, 4]))
    d.apply(batch("b", EventType.DELETE, [1], tier=Tier.L2))
    d.apply(batch("a", EventType.ACCESS, [0, 1]))
    d.fence(InstanceId("a"))
    assert KeyDirectory.restore(cap.encode()).digest() == expected != d.digest()


def test_namespaces_are_separate() -> None:
    d = KeyDirectory()
    other = Namespace("other", default_kv_rank(), 0, "salt")
    d.apply(batch("a", EventType.STORE, [0], ns=other))
    assert d.lookup_prefix(HASHES[:1], NS).holders == ()
    assert d.lookup_prefix(HASHES[:1], other).holders[0].instance_id == "a"


def test_fence_removes_l1_of_one_instance_and_keeps_l2() -> None:
    d = KeyDirectory()
    d.apply(batch("a", EventType.STORE, [0, 1, 2]))
    d.apply(batch("a", EventType.STORE, [0, 1], tier=Tier.L2))
    d.apply(batch("b", EventType.STORE, [0]))
    assert d.fence(InstanceId("a")) == 3
    tiers = {(p.instance_id, p.tier) for _, _, ps in d.iter_keys() for p in ps}
    assert tiers == {("a", Tier.L2), ("b", Tier.L1)}
    assert d.fence(InstanceId("a")) == 0


def test_fence_below_keeps_the_new_incarnation() -> None:
    d = KeyDirectory()
    d.apply(batch("a", EventType.STORE, [0, 1], inc=1))
    d.apply(batch("a", EventType.STORE, [1, 2], inc=2))
    assert d.fence_below(InstanceId("a"), Incarnation(2)) == 2
    assert {(p.incarnation) for _, _, ps in d.iter_keys() for p in ps} == {2}


def test_reverse_index_is_compacted_under_churn() -> None:
    d = KeyDirectory()
    for _ in range(600):
        d.apply(batch("a", EventType.STORE, [0, 1, 2, 3, 4, 5]))
        d.apply(batch("a", EventType.DELETE, [0, 1, 2, 3, 4, 5]))
    assert all(len(rev) <= 2 * 6 + 1024 + 6 for rev in d.tables.rev.values())
    assert len(d) == 0


def _tracked_references(d: KeyDirectory) -> int:
    """References the garbage collector visits in ``d``'s state at a full collection
    (classes and modules left out: they are everyone's)."""
    seen: set[int] = set()
    stack = gc.get_referents(d)
    total = 0
    while stack:
        o = stack.pop()
        if id(o) in seen or not gc.is_tracked(o) or isinstance(o, type | types.ModuleType):
            continue
        seen.add(id(o))
        refs = gc.get_referents(o)
        total += len(refs)
        stack.extend(refs)
    return total


def test_a_full_collection_does_not_visit_every_key() -> None:
    """The reverse index keeps its keys where the collector does not look (tuples of
    ints): a full collection costs the same at 60,000 keys as at 6,000."""

    def store(ids: range | list[int]) -> EventBatch:
        entries = tuple(Entry(ObjectKey(i.to_bytes(8, "big") * 4, "m", 1), 100) for i in ids)
        return EventBatch(InstanceId("a"), Incarnation(1), 1, EventType.STORE, Tier.L1, entries)

    d = KeyDirectory()
    for start in range(0, 60_000, 256):
        d.apply(store(range(start, start + 256)))
    d.apply(store([7, 70_001, 70_002]))  # a repeat: the path that appends one at a time
    gc.collect()
    stored = len(d)
    assert stored >= 60_000
    assert _tracked_references(d) < 10_000
    assert d.fence(InstanceId("a")) == stored  # fencing still walks every key of the log
    assert len(d) == 0


def test_bad_batch_applies_nothing() -> None:
    d = KeyDirectory()
    good = Entry(key(0), 1)
    bad = Entry(key(1), -5)
    with pytest.raises(InvalidInput):
        d.apply(
            EventBatch(InstanceId("a"), Incarnation(1), 1, EventType.STORE, Tier.L1, (good, bad))
        )
    assert len(d) == 0
    short = Entry(ObjectKey(b"abc", "m", 1), 1)
    with pytest.raises(InvalidInput):
        d.apply(
            EventBatch(InstanceId("a"), Incarnation(1), 1, EventType.STORE, Tier.L1, (good, short))
        )
    assert len(d) == 0


def test_stats_per_tier_and_owner() -> None:
    d = KeyDirectory()
    d.apply(batch("a", EventType.STORE, [0, 1], size=10))
    d.apply(batch("b", EventType.STORE, [1], tier=Tier.L2, size=7))
    s = d.stats()
    assert (s.keys, s.placements, s.bytes) == (2, 3, 27)
    assert s.placements_by_tier == {"l1": 2, "l2": 1}
    assert s.bytes_by_tier == {"l1": 20, "l2": 7}
    assert {(o.instance_id, o.placements) for o in s.owners} == {("a", 2), ("b", 1)}


def test_snapshot_restore_is_a_replay_with_the_same_digest() -> None:
    d = KeyDirectory(keep_tokens=True)
    d.apply(batch("a", EventType.STORE, [0, 1, 2]))
    d.apply(batch("b", EventType.STORE, [1], tier=Tier.L2, size=9))
    d.apply(batch("a", EventType.ACCESS, [1]))
    tokens = tuple(range(256))
    d.apply(
        EventBatch(
            InstanceId("c"),
            Incarnation(1),
            1,
            EventType.STORE,
            Tier.L1,
            (Entry(key(4), 5, tokens, 0),),
        )
    )
    restored = KeyDirectory.restore(d.snapshot(), keep_tokens=True)
    assert restored.digest() == d.digest()
    assert restored.lookup_keys([key(4)])[0].token_ids == tokens
    assert restored.fence(InstanceId("a")) == 3  # the reverse index was rebuilt too
    with pytest.raises(SnapshotError):
        KeyDirectory.restore(b"not a snapshot")


def test_snapshot_of_several_namespaces_restores_them_all() -> None:
    # A second namespace makes the directory's key ints exceed 64 bits; version 1 of the
    # format wrote them as they were, and msgpack refused to encode them.
    d = KeyDirectory(keep_tokens=True)
    b_ns, c_ns = Namespace("b", default_kv_rank()), Namespace("c", default_kv_rank(), 3, "x")
    d.apply(batch("a", EventType.STORE, [0, 1]))
    d.apply(batch("a", EventType.STORE, [0, 2], ns=b_ns))
    d.apply(batch("b", EventType.STORE, [5], tier=Tier.L2, ns=c_ns))
    d.apply(batch("a", EventType.ACCESS, [2], ns=b_ns))
    tokens = tuple(range(256))
    d.apply(
        EventBatch(
            InstanceId("c"),
            Incarnation(1),
            1,
            EventType.STORE,
            Tier.L1,
            (Entry(key(3, c_ns), 5, tokens, 0),),
        )
    )
    restored = KeyDirectory.restore(d.snapshot(), keep_tokens=True)
    assert restored.digest() == d.digest()
    assert restored.lookup_keys([key(2, b_ns)])[0].access_count == 1
    assert restored.lookup_keys([key(3, c_ns)])[0].token_ids == tokens
    assert restored.fence(InstanceId("a")) == 4


def test_a_version_1_snapshot_still_restores() -> None:
    # What version 1 wrote for one namespace: owners as (owner, key ints, sizes), access
    # and tokens keyed by the key ints (here the bare hash prefixes).
    d = KeyDirectory(keep_tokens=True)
    d.apply(batch("a", EventType.STORE, [0, 1]))
    d.apply(batch("a", EventType.ACCESS, [1]))
    d.apply(
        EventBatch(
            InstanceId("c"),
            Incarnation(1),
            1,
            EventType.STORE,
            Tier.L1,
            (Entry(key(4), 5, (7,) * 256, 0),),
        )
    )
    v2 = msgspec.msgpack.decode(d.snapshot())
    owners_v1 = [[owner, keys, sizes] for owner, _ns, keys, sizes in v2[2]]
    access_v1 = [[prefix, n] for _ns, prefix, n in v2[3]]
    tokens_v1 = [[prefix, off, toks] for _ns, prefix, off, toks in v2[4]]
    v1 = msgspec.msgpack.encode([1, v2[1], owners_v1, access_v1, tokens_v1])
    assert KeyDirectory.restore(v1, keep_tokens=True).digest() == d.digest()
    with pytest.raises(SnapshotError, match="version 7"):
        KeyDirectory.restore(msgspec.msgpack.encode([7, [], [], [], []]))


# ---- the key block form ------------------------------------------------------------------

OTHER = Namespace("other", default_kv_rank(), 0, "s")

Step = tuple[str, EventType, Tier, Namespace, list[int], list[int]]
"""(instance, kind, tier, namespace, hash indexes, sizes): one batch of a scenario."""

SCENARIO: list[Step] = [
    ("a", EventType.STORE, Tier.L1, NS, [0, 1, 2, 3], [10, 10, 10, 10]),
    ("b", EventType.STORE, Tier.L1, NS, [2, 3, 4, 5], [7, 8, 9, 10]),
    ("a", EventType.STORE, Tier.L1, OTHER, [0, 1], [5, 5]),  # namespace id 1
    ("a", EventType.STORE, Tier.L1, NS, [3, 4, 4, 5, 3], [1, 2, 3, 4, 5]),  # present, dups
    ("a", EventType.STORE, Tier.L2, NS, [5, 5, 5], [6, 6, 6]),  # duplicates only
    ("a", EventType.ACCESS, Tier.L1, NS, [0, 0, 5, 1], [0, 0, 0, 0]),
    ("c", EventType.ACCESS, Tier.L1, OTHER, [0, 4], [0, 0]),
    ("a", EventType.DELETE, Tier.L1, NS, [0, 4, 4, 2], [0, 0, 0, 0]),
    ("c", EventType.DELETE, Tier.L1, NS, [1], [0]),  # unknown owner
    ("b", EventType.DELETE, Tier.L1, Namespace("never", 1), [1, 2], [0, 0]),
    ("a", EventType.STORE, Tier.L1, NS, [0, 4, 2, 1], [3, 3, 3, 3]),  # re-create
]


def as_entries(step: Step) -> EventBatch:
    iid, kind, tier, ns, idx, sizes = step
    entries = tuple(Entry(key(i, ns), s) for i, s in zip(idx, sizes, strict=True))
    return EventBatch(InstanceId(iid), Incarnation(1), 1, kind, tier, entries)


def as_block(step: Step, split: int) -> EventBatch:
    """The same batch with its first ``split`` objects as entries, the rest as a block."""
    iid, kind, tier, ns, idx, sizes = step
    head = as_entries(step).entries[:split]
    block = KeyBlock.of(ns, [HASHES[i] for i in idx[split:]], sizes[split:])
    return EventBatch(InstanceId(iid), Incarnation(1), 1, kind, tier, head, block=block)


@pytest.mark.parametrize("split", [0, 1, 2])
def test_block_batches_apply_like_their_entries(split: int) -> None:
    plain, blocks = KeyDirectory(), KeyDirectory()
    for step in SCENARIO:
        want = plain.apply(as_entries(step))
        got = blocks.apply(as_block(step, min(split, len(step[4]))))
        assert got == want, step
        assert blocks.canonical() == plain.canonical(), step
        assert blocks.digest() == plain.digest(), step
        assert blocks.stats() == plain.stats(), step
    assert plain.fence(InstanceId("a")) == blocks.fence(InstanceId("a")) > 0
    assert blocks.digest() == plain.digest()
    assert KeyDirectory.restore(blocks.snapshot()).digest() == plain.digest()


def test_block_with_entries_that_carry_tokens() -> None:
    d = KeyDirectory(keep_tokens=True)
    tokens = tuple(range(256))
    b = EventBatch(
        InstanceId("a"),
        Incarnation(1),
        1,
        EventType.STORE,
        Tier.L1,
        (Entry(key(0), 5, tokens, 0),),
        block=KeyBlock.of(NS, HASHES[1:3], 5),
    )
    assert d.apply(b).created == 3
    r0, r1, r2 = d.lookup_keys([key(0), key(1), key(2)])
    assert r0.token_ids == tokens and r1.token_ids is None and r2.placements


def test_bad_block_applies_nothing() -> None:
    d = KeyDirectory()
    d.apply(batch("a", EventType.STORE, [0]))
    before = (d.digest(), d.stats())
    head = (Entry(key(1), 1),)
    bad_blocks = [
        KeyBlock(NS, b"".join(HASHES[2:4])[:-1], (1, 1)),  # blob one byte short
        KeyBlock(NS, b"".join(HASHES[2:4]), (1,)),  # two hashes, one size
        KeyBlock(OTHER, b"".join(HASHES[2:4]), (1, -1)),
        KeyBlock(OTHER, b"".join(HASHES[2:4]), (1, 1 << 40)),
    ]
    for block in bad_blocks:
        for kind in EventType:
            if kind is not EventType.STORE and len(set(block.sizes)) == 2:
                continue  # sizes matter to STORE only
            with pytest.raises(InvalidInput):
                d.apply(
                    EventBatch(InstanceId("a"), Incarnation(1), 2, kind, Tier.L1, head, block=block)
                )
            assert (d.digest(), d.stats()) == before
    with pytest.raises(InvalidInput, match="hashes for 2 sizes"):
        d.apply(
            EventBatch(
                InstanceId("a"),
                Incarnation(1),
                2,
                EventType.STORE,
                Tier.L1,
                (),
                block=bad_blocks[0],
            )
        )


def test_owners_that_hold_nothing_any_more_are_freed() -> None:
    """20k owners stored then deleted (or fenced) free their owner entries."""
    d = KeyDirectory()
    for i in range(20_000):
        tier = Tier.L1 if i % 2 else Tier.L2
        d.apply(batch(f"i{i}", EventType.STORE, [i % 5, 1 + i % 5], tier=tier, size=i))
        if i % 4 == 1:
            d.fence(InstanceId(f"i{i}"))
            d.apply(batch(f"i{i}", EventType.DELETE, [i % 5], tier=tier))  # nothing left
        else:
            d.apply(batch(f"i{i}", EventType.DELETE, [i % 5, 1 + i % 5], tier=tier))
        d.apply(batch(f"e{i}", EventType.STORE, []))  # an empty store creates no owner
    assert len(d) == 0 and d.stats().owners == ()
    assert len(d.tables.owners) <= 2 and len(d.tables.owner_ids) == 0
    assert d.tables.owners_by_instance == {} and d.tables.rev == {} and len(d.tables.codes) == 0


def test_a_reused_owner_id_never_answers_for_the_old_owner() -> None:
    d = KeyDirectory()
    d.apply(batch("a", EventType.STORE, [0], size=100))
    assert [p.instance_id for p in d.lookup_keys([key(0)])[0].placements] == ["a"]
    d.apply(batch("a", EventType.DELETE, [0]))
    d.apply(batch("b", EventType.STORE, [0], size=100))  # takes a's freed id
    assert [p.instance_id for p in d.lookup_keys([key(0)])[0].placements] == ["b"]
    restored = KeyDirectory.restore(d.snapshot())
    assert restored.digest() == d.digest()


def test_namespaces_that_hold_no_key_any_more_are_freed() -> None:
    """20k namespaces stored then deleted free their entries; only the
    namespace still holding keys stays."""
    d = KeyDirectory()
    keep = batch("k", EventType.STORE, [0, 1])
    d.apply(keep)
    for i in range(20_000):
        ns = Namespace(f"model-{i}", i)
        if i % 3 == 0:  # the block form
            b = EventBatch(
                InstanceId("a"),
                Incarnation(1),
                1,
                EventType.STORE,
                Tier.L2,
                (),
                block=KeyBlock.of(ns, [HASHES[i % 5]], 10),
            )
        else:
            b = batch("a", EventType.STORE, [i % 5, 1 + i % 5], ns=ns)
        d.apply(b)
        if i % 2:
            d.apply(msgspec.structs.replace(b, event_type=EventType.DELETE))
        else:
            d.fence(InstanceId("a"))
            d.apply(batch("a", EventType.DELETE, [i % 5, 1 + i % 5], tier=Tier.L2, ns=ns))
    assert len(d) == 2 and d.stats().namespaces == 1
    assert len(d.tables.ns_ids) == 1 and len(d.tables.namespaces) <= 3
    restored = KeyDirectory.restore(d.snapshot())
    assert restored.digest() == d.digest() and len(restored.tables.namespaces) == 1


def test_a_reused_namespace_id_finds_only_its_own_keys() -> None:
    d = KeyDirectory()
    other = Namespace("other", 0)
    d.apply(batch("a", EventType.STORE, [0], ns=other))
    d.apply(batch("a", EventType.DELETE, [0], ns=other))
    d.apply(batch("a", EventType.STORE, [0]))  # NS takes other's freed id
    assert d.lookup_keys([key(0, other)])[0].placements == ()
    assert [p.instance_id for p in d.lookup_keys([key(0)])[0].placements] == ["a"]
    assert KeyDirectory.restore(d.snapshot()).digest() == d.digest()


def test_reads_and_writes_share_the_tables_they_were_built_with() -> None:
    """The parts hold direct references to the tables for their hot paths, so no change
    may replace a table: after churn that frees owners and namespaces, compacts the
    reverse index, fences and restores, every reference still is the tables' own."""
    d = KeyDirectory(keep_tokens=True)
    for i in range(300):
        ns = Namespace(f"m{i % 3}", 0)
        d.apply(batch(f"i{i % 7}", EventType.STORE, [i % 5, 1 + i % 5], size=i, ns=ns))
        d.apply(batch(f"i{i % 7}", EventType.ACCESS, [i % 5], ns=ns))
        if i % 5 == 0:
            d.apply(batch(f"i{i % 7}", EventType.DELETE, [i % 5, 1 + i % 5], ns=ns))
        if i % 11 == 0:
            d.fence(InstanceId(f"i{i % 7}"))
    for _ in range(300):  # enough churn to compact one reverse index
        d.apply(batch("c", EventType.STORE, [0, 1, 2, 3, 4, 5]))
        d.apply(batch("c", EventType.DELETE, [0, 1, 2, 3, 4]))
    d.drop(InstanceId("i3"))
    restored = KeyDirectory.restore(d.snapshot(), keep_tokens=True)
    for directory in (d, restored):
        tables = directory.tables
        for part in (directory.reads, directory.writes):
            refs = [s for s in type(part).__slots__ if s != "_tables"]
            assert refs
            for slot in refs:
                assert getattr(part, slot) is getattr(tables, slot[1:]), slot
    assert restored.digest() == d.digest()
