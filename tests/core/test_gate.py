"""The event gate: stale, duplicate, new incarnation, gaps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvatlas.core.coordinator.gate import Cursor, Verdict, admit
from kvatlas.core.types import Incarnation


def test_first_batch_applies() -> None:
    a = admit(None, Incarnation(5), 1)
    assert a.verdict is Verdict.APPLY
    assert a.cursor == Cursor(Incarnation(5), 1)
    assert a.fence_incarnation is None
    assert a.gap == 0


def test_first_batch_after_lost_ones_is_a_gap() -> None:
    a = admit(None, Incarnation(5), 4)
    assert a.verdict is Verdict.APPLY
    assert a.gap == 3
    assert a.cursor.gaps == 1
    assert a.cursor.missing == 3


def test_in_order_duplicate_and_stale() -> None:
    c = Cursor(Incarnation(5), 3)
    assert admit(c, Incarnation(5), 4).verdict is Verdict.APPLY
    assert admit(c, Incarnation(5), 3).verdict is Verdict.DUPLICATE
    assert admit(c, Incarnation(5), 1).verdict is Verdict.DUPLICATE
    stale = admit(c, Incarnation(4), 100)
    assert stale.verdict is Verdict.STALE
    assert stale.cursor == c


def test_new_incarnation_fences_the_old_one() -> None:
    a = admit(Cursor(Incarnation(5), 9), Incarnation(6), 1)
    assert a.verdict is Verdict.APPLY
    assert a.fence_incarnation == 5
    assert a.cursor == Cursor(Incarnation(6), 1)


def test_gap_is_counted_and_kept() -> None:
    a = admit(Cursor(Incarnation(5), 3, gaps=1, missing=2), Incarnation(5), 7)
    assert a.verdict is Verdict.APPLY
    assert a.gap == 3
    assert a.cursor == Cursor(Incarnation(5), 7, gaps=2, missing=5)
    # a late batch from inside the gap must not apply: it could resurrect deleted keys
    assert admit(a.cursor, Incarnation(5), 5).verdict is Verdict.DUPLICATE


@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 8)), max_size=40))
def test_applied_positions_strictly_increase(stream: list[tuple[int, int]]) -> None:
    cursor: Cursor | None = None
    applied: list[tuple[int, int]] = []
    for inc, seq in stream:
        a = admit(cursor, Incarnation(inc), seq)
        if a.verdict is Verdict.APPLY:
            cursor = a.cursor
            applied.append((inc, seq))
        else:
            assert a.cursor == cursor
    assert applied == sorted(set(applied))
    if cursor is not None:
        assert cursor.missing >= 0
