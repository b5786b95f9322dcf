"""The router's index of prefixes in flight, without I/O."""

from __future__ import annotations

import numpy as np

from kvatlas.router.pending import PendingPrefixes


def blob(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def test_leading_prefixes_per_engine_until_they_expire() -> None:
    p = PendingPrefixes(chunk_size=4, ttl_s=10.0)
    doc = list(range(10))  # two full chunks and a rest
    p.note(blob(doc), "a", now=0.0)
    assert p.leading(blob([*doc, 7, 7]), now=1.0) == {"a": 8}
    p.note(blob(doc[:4] + [99] * 4), "b", now=5.0)  # b shares doc's first chunk
    assert p.leading(blob([*doc, 7, 7]), now=6.0) == {"a": 8, "b": 4}
    assert p.leading(blob(doc[:4] + [99] * 6), now=6.0) == {"a": 4, "b": 8}
    assert p.leading(blob([1, *doc]), now=1.0) == {}  # not a prefix
    assert p.leading(blob(doc), now=12.0) == {"b": 4}  # a's notes expired, not b's
    assert p.leading(blob(doc), now=16.0) == {}


def test_the_index_is_bounded() -> None:
    p = PendingPrefixes(chunk_size=2, ttl_s=100.0, max_prefixes=3)
    p.note(blob([1, 2, 3, 4]), "a", now=0.0)
    p.note(blob([5, 6, 7, 8]), "b", now=0.0)
    assert len(p) == 3
    assert p.leading(blob([1, 2, 3, 4]), now=1.0) == {}  # its first chunk went first
    assert p.leading(blob([5, 6, 7, 8]), now=1.0) == {"b": 4}


def test_a_failed_attempt_forgets_only_its_engine() -> None:
    p = PendingPrefixes(chunk_size=4, ttl_s=10.0)
    doc = list(range(8))
    p.note(blob(doc), "a", now=0.0)
    p.note(blob(doc), "b", now=0.0)
    p.forget(blob(doc), "b")
    assert p.leading(blob(doc), now=1.0) == {"a": 8}
    p.forget(blob(doc), "a")
    assert p.leading(blob(doc), now=1.0) == {}
    assert len(p) == 0  # keys nobody claims go
    p.forget(blob(doc), "a")  # forgetting twice is harmless
