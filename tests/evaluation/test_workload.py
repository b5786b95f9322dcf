"""The workload generator: deterministic, shaped as configured, and the expected KV."""

from __future__ import annotations

import itertools

import numpy as np

from kvatlas.evaluation.workload import VOCAB_SIZE, WorkloadConfig, expected_kv, generate


def test_same_seed_same_stream_and_other_seed_differs() -> None:
    cfg = WorkloadConfig(requests=200, nodes=3, seed=5)
    a, b = generate(cfg), generate(cfg)
    assert [(r.kind, r.node, r.group) for r in a] == [(r.kind, r.node, r.group) for r in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b, strict=True))
    c = generate(WorkloadConfig(requests=200, nodes=3, seed=6))
    assert any(not np.array_equal(x.tokens, y.tokens) for x, y in zip(a, c, strict=True))


def test_stream_shape() -> None:
    cfg = WorkloadConfig(requests=600, nodes=4, seed=1)
    reqs = generate(cfg)
    assert len(reqs) == 600
    assert {r.node for r in reqs} == {0, 1, 2, 3}
    assert {r.kind for r in reqs} == {"doc_qa", "chat", "fresh"}
    for r in reqs:
        assert r.tokens.min() >= 0 and r.tokens.max() < VOCAB_SIZE
        assert len(r.tokens) <= cfg.max_tokens
    # chat turns of one session extend the previous turn's prompt (history grows)
    by_session: dict[str, list[np.ndarray]] = {}
    for r in reqs:
        if r.kind == "chat":
            by_session.setdefault(r.group, []).append(r.tokens)
    grown = [s for s in by_session.values() if len(s) > 1]
    assert grown
    for turns in grown:
        for prev, cur in itertools.pairwise(turns):
            assert len(cur) > len(prev) and np.array_equal(cur[: len(prev)], prev)
    # Zipf: the most popular document is asked for far more than the median one
    docs = [r.group for r in reqs if r.kind == "doc_qa"]
    counts = sorted((docs.count(g) for g in set(docs)), reverse=True)
    assert counts[0] >= 4 * counts[len(counts) // 2]


def test_expected_kv_is_deterministic_and_hash_specific() -> None:
    h1, h2 = bytes(32), bytes([1]) + bytes(31)
    assert np.array_equal(expected_kv(h1, 4096), expected_kv(h1, 4096))
    assert not np.array_equal(expected_kv(h1, 4096), expected_kv(h2, 4096))
    assert expected_kv(h1, 1000).shape == (1000,)
