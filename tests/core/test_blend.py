"""The blend index finds stored chunks at any offset and never returns a wrong match."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.core.coordinator.blend import BlendIndex, BlendMatch, BlendStats
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import Namespace

NS = Namespace("model-a", 16777472)
N = 8

Stored = dict[bytes, tuple[tuple[int, ...], int]]


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def oracle(stored: Stored, query: list[int], n: int) -> list[BlendMatch]:
    """The documented policy, brute force: greedy left to right, no overlap, least shift."""
    out: list[BlendMatch] = []
    free_from = 0
    for cur in range(len(query) - n + 1):
        if cur < free_from:
            continue
        window = tuple(query[cur : cur + n])
        hits = [(abs(s - cur), ch, s) for ch, (toks, s) in stored.items() if toks == window]
        if hits:
            _, ch, s = min(hits)
            out.append(BlendMatch(ch, s, cur))
            free_from = cur + n
    return out


def assert_verified(stored: Stored, query: list[int], matches: list[BlendMatch], n: int) -> None:
    prev_end = 0
    for m in matches:
        toks, start = stored[m.chunk_hash]
        assert tuple(query[m.cur_st : m.cur_st + n]) == toks
        assert m.old_st == start
        assert m.cur_st >= prev_end
        prev_end = m.cur_st + n


# --- hypothesis: planted chunks are found where they were planted -----------------------


@st.composite
def planted(draw: st.DrawFn) -> tuple[Stored, list[int], list[tuple[bytes, int]]]:
    """Stored chunks (tokens < 1000, unique first token) and a query of filler tokens
    (>= 1000) with some of them planted at gaps of at least one filler token."""
    n_chunks = draw(st.integers(1, 12))
    stored: Stored = {}
    for i in range(n_chunks):
        rest = draw(st.lists(st.integers(0, 999), min_size=N - 1, max_size=N - 1))
        stored[h(i)] = ((i, *rest), draw(st.integers(0, 10_000)))
    picks = draw(st.lists(st.sampled_from(sorted(stored)), max_size=6))
    filler = st.lists(st.integers(1000, 2**32 - 1), min_size=1, max_size=20)
    query: list[int] = list(draw(filler))
    expected: list[tuple[bytes, int]] = []
    for ch in picks:
        expected.append((ch, len(query)))
        query.extend(stored[ch][0])
        query.extend(draw(filler))
    return stored, query, expected


@settings(max_examples=150)
@given(planted())
def test_planted_chunks_are_found_at_their_offsets(
    case: tuple[Stored, list[int], list[tuple[bytes, int]]],
) -> None:
    stored, query, expected = case
    idx = BlendIndex(N)
    for ch, (toks, start) in stored.items():
        assert idx.add(NS, ch, list(toks), start)
    matches = idx.lookup(NS, np.array(query, dtype=np.uint32))
    assert [(m.chunk_hash, m.old_st, m.cur_st) for m in matches] == [
        (ch, stored[ch][1], cur) for ch, cur in expected
    ]


# --- hypothesis: equal to the brute-force model, also under forced collisions -----------


@settings(max_examples=200)
@given(
    chunks=st.lists(
        st.tuples(st.lists(st.integers(0, 2), min_size=4, max_size=4), st.integers(0, 64)),
        max_size=10,
    ),
    query=st.lists(st.integers(0, 2), max_size=40),
    base=st.sampled_from([1, 3, 0x9E3779B97F4A7C15]),
)
def test_lookup_equals_brute_force_model(
    chunks: list[tuple[list[int], int]], query: list[int], base: int
) -> None:
    # A three-letter alphabet gives accidental matches, equal tokens under different hashes
    # and, with base 1 (fingerprint = token sum), fingerprint collisions galore.
    n = 4
    idx = BlendIndex(n, base=base)
    stored: Stored = {}
    for i, (toks, start) in enumerate(chunks):
        stored[h(i)] = (tuple(toks), start)
        idx.add(NS, h(i), toks, start)
    matches = idx.lookup(NS, query)
    assert_verified(stored, query, matches, n)
    assert matches == oracle(stored, query, n)


@settings(max_examples=100)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=N, max_size=60),
    base=st.sampled_from([1, 5, 0x9E3779B97F4A7C15, 2**64 - 1]),
)
def test_window_fingerprint_is_position_independent(tokens: list[int], base: int) -> None:
    idx = BlendIndex(N, base=base)
    arr = np.array(tokens, dtype=np.uint32)
    windows = idx._window_fingerprints(arr)
    assert len(windows) == len(tokens) - N + 1
    for i in range(len(windows)):
        assert int(windows[i]) == idx._fingerprint(arr[i : i + N])


# --- forced collisions -------------------------------------------------------------------


class ConstantFingerprint(BlendIndex):
    """Every chunk and every window has the same fingerprint."""

    def _fingerprint(self, tokens: npt.NDArray[np.uint32]) -> int:
        return 7

    def _window_fingerprints(self, tokens: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint64]:
        return np.full(len(tokens) - self.chunk_size + 1, 7, dtype=np.uint64)


@settings(max_examples=100)
@given(
    chunks=st.lists(st.lists(st.integers(0, 3), min_size=3, max_size=3), max_size=8),
    query=st.lists(st.integers(0, 3), max_size=30),
)
def test_constant_fingerprint_never_yields_a_wrong_match(
    chunks: list[list[int]], query: list[int]
) -> None:
    idx = ConstantFingerprint(3)
    stored: Stored = {}
    for i, toks in enumerate(chunks):
        stored[h(i)] = (tuple(toks), 10 * i)
        idx.add(NS, h(i), toks, 10 * i)
    matches = idx.lookup(NS, query)
    assert_verified(stored, query, matches, 3)
    assert matches == oracle(stored, query, 3)


def test_permuted_tokens_collide_but_do_not_match() -> None:
    idx = BlendIndex(4, base=1)  # fingerprint = sum of tokens
    idx.add(NS, h(1), [1, 2, 3, 4], 0)
    assert idx.lookup(NS, [9, 4, 3, 2, 1, 9]) == []
    assert idx.lookup(NS, [9, 4, 1, 2, 3, 4]) == [BlendMatch(h(1), 0, 2)]


# --- scoping, removal, upsert, snapshot ------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [
        Namespace("model-b", 16777472),
        Namespace("model-a", 16777473),
        Namespace("model-a", 16777472, object_group_id=1),
        Namespace("model-a", 16777472, cache_salt="tenant-2"),
    ],
)
def test_results_come_only_from_the_same_namespace(other: Namespace) -> None:
    idx = BlendIndex(N)
    toks = list(range(100, 100 + N))
    idx.add(NS, h(1), toks, 16)
    query = [5, 6, *toks, 7]
    assert idx.lookup(other, query) == []
    assert idx.lookup(Namespace("model-a", 16777472), query) == [BlendMatch(h(1), 16, 2)]
    idx.add(other, h(2), toks, 32)
    assert idx.lookup(other, query) == [BlendMatch(h(2), 32, 2)]
    assert idx.lookup(NS, query) == [BlendMatch(h(1), 16, 2)]
    assert idx.stats() == BlendStats(chunks=2, namespaces=2, token_bytes=2 * N * 4)


def test_remove_forgets_the_chunk_and_empty_namespaces() -> None:
    idx = BlendIndex(N)
    a, b = list(range(N)), list(range(50, 50 + N))
    idx.add(NS, h(1), a, 0)
    idx.add(NS, h(2), b, N)
    assert len(idx) == 2
    assert idx.remove(NS, h(1))
    assert not idx.remove(NS, h(1))
    assert not idx.remove(Namespace("other", 1), h(2))
    assert idx.lookup(NS, a + b) == [BlendMatch(h(2), N, N)]
    assert idx.remove(NS, h(2))
    assert len(idx) == 0
    assert idx.stats() == BlendStats(chunks=0, namespaces=0, token_bytes=0)
    assert idx.lookup(NS, a + b) == []


def test_same_tokens_under_two_hashes_prefers_least_shift_and_survives_removal() -> None:
    idx = BlendIndex(N)
    toks = list(range(7, 7 + N))
    idx.add(NS, h(1), toks, 0)
    idx.add(NS, h(2), toks, 256)
    query = [0] * 250 + toks
    assert idx.lookup(NS, query) == [BlendMatch(h(2), 256, 250)]
    assert idx.lookup(NS, toks) == [BlendMatch(h(1), 0, 0)]
    idx.remove(NS, h(2))
    assert idx.lookup(NS, query) == [BlendMatch(h(1), 0, 250)]


def test_add_is_an_upsert() -> None:
    idx = BlendIndex(N)
    old, new = list(range(N)), list(range(10, 10 + N))
    idx.add(NS, h(1), old, 0)
    idx.add(NS, h(1), new, 8)
    assert len(idx) == 1
    assert idx.lookup(NS, old) == []
    assert idx.lookup(NS, new) == [BlendMatch(h(1), 8, 0)]


def test_overlapping_windows_are_skipped_greedily() -> None:
    idx = BlendIndex(4)
    idx.add(NS, h(1), [1, 1, 1, 1], 0)
    assert idx.lookup(NS, [1] * 11) == [
        BlendMatch(h(1), 0, 0),
        BlendMatch(h(1), 0, 4),
    ]


def test_partial_chunks_are_ignored_and_nonsense_is_refused() -> None:
    idx = BlendIndex(N)
    assert not idx.add(NS, h(1), list(range(N - 1)), 0)
    assert not idx.add(NS, h(1), list(range(N + 1)), 0)
    assert len(idx) == 0
    with pytest.raises(InvalidInput):
        idx.add(NS, h(1), list(range(N)), -1)
    with pytest.raises(InvalidInput):
        idx.add(NS, h(1), [-1, *range(N - 1)], 0)
    with pytest.raises(InvalidInput):
        idx.add(NS, h(1), [2**32, *range(N - 1)], 0)
    with pytest.raises(InvalidInput):
        BlendIndex(0)
    with pytest.raises(InvalidInput):
        BlendIndex(N, base=2)
    assert idx.lookup(NS, list(range(N - 1))) == []
    assert idx.lookup(NS, []) == []


def test_query_forms_agree() -> None:
    idx = BlendIndex(N)
    toks = list(range(1000, 1000 + N))
    idx.add(NS, h(1), np.array(toks, dtype=np.uint32), 3)
    query = [1, *toks]
    want = [BlendMatch(h(1), 3, 1)]
    assert idx.lookup(NS, query) == want
    assert idx.lookup(NS, np.array(query, dtype=np.int64)) == want
    assert idx.lookup(NS, np.array(query, dtype="<u4").tobytes()) == want


def test_snapshot_replay_rebuilds_the_same_index() -> None:
    rng = np.random.default_rng(7)
    idx = BlendIndex(N)
    namespaces = [NS, Namespace("model-b", 1, cache_salt="s")]
    for i in range(200):
        idx.add(namespaces[i % 2], h(i), rng.integers(0, 50, N, dtype=np.uint32), i * N)
    for i in range(0, 200, 3):
        idx.remove(namespaces[i % 2], h(i))
    replayed = BlendIndex(N)
    for ns, ch, toks, start in idx.snapshot_items():
        assert toks.dtype == np.uint32
        assert replayed.add(ns, ch, toks, start)
    assert replayed.stats() == idx.stats()
    query = rng.integers(0, 50, 4000, dtype=np.uint32)
    for i in (i for i in range(1, 200, 7) if i % 3):
        toks = next(t for ns, ch, t, _ in idx.snapshot_items() if ch == h(i))
        query[i * 19 : i * 19 + N] = toks
    assert any(idx.lookup(ns, query) for ns in namespaces)
    for ns in namespaces:
        assert replayed.lookup(ns, query) == idx.lookup(ns, query)


def test_many_chunks_grow_the_slot_table_without_losing_any() -> None:
    rng = np.random.default_rng(3)
    idx = BlendIndex(16)
    chunks = rng.integers(0, 2**32 - 1, (5000, 16), dtype=np.uint32)
    for i, toks in enumerate(chunks):
        idx.add(NS, h(i), toks, 16 * i)
    for i in range(0, 5000, 2):
        idx.remove(NS, h(i))
    query = chunks[4000:4100].reshape(-1)
    matches = idx.lookup(NS, query)
    assert [(m.chunk_hash, m.old_st, m.cur_st) for m in matches] == [
        (h(i), 16 * i, 16 * (i - 4000)) for i in range(4001, 4100, 2)
    ]
