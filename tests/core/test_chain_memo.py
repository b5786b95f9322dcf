"""The memo of the compiled chain (`_chain.ChainMemo`, made by `keys.chain_memo`).

Properties: whatever prompts come, in whatever order, with whatever memo size (down to one
set, so that links evict each other), a chain through the memo gives the Python loop's
bytes; a link is admitted on its second miss and found from then on; a call that finds
the memo busy (another thread's big chain holds it, without the GIL) hashes without it.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.core import keys
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import NONE_HASH, ChainMemo, chain_memo, chunk_hash_blob
from kvatlas.core.types import ChunkHash

PREFIX = bytes(NONE_HASH)
SET_BYTES = {n: 64 + 4 * ((64 + 4 * n + 7) // 8 * 8) for n in (1, 7, 256)}
"""The least memory of a memo (one set of 4 links) by chunk size: a set's cache line of
tags, and per link its parent, its hash and its tokens (to a multiple of 8 bytes)."""


@pytest.fixture(scope="module")
def module(compiled_module: ModuleType) -> ModuleType:
    return compiled_module


@pytest.fixture(scope="module", params=["installed", "colliding tags"])
def any_module(
    request: pytest.FixtureRequest, compiled_module: ModuleType, colliding_module: ModuleType
) -> ModuleType:
    """The installed chain, and a build whose memo tags all collide within a set."""
    return compiled_module if request.param == "installed" else colliding_module


def memo_of(
    module: ModuleType, chunk_size: int, max_bytes: int, seed: bytes | None = None
) -> ChainMemo:
    """A memo keyed at random, or by ``seed`` where a test counts exact hits: with a
    random key, 3 of a prompt's links can share a set (its 2 ghosts then forget the
    first before it comes again), which took ~0.7% of random keys here."""
    memo: ChainMemo = module.ChainMemo(chunk_size, max_bytes, seed or os.urandom(32))
    return memo


COUNTING_SEED = bytes(range(32))
"""A fixed key for the exact-count test: where its links fall is then the same in every
run (under this key the counts are the ones the test states)."""


def raw(tokens: list[int] | np.ndarray) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


@st.composite
def prompts(draw: st.DrawFn) -> tuple[int, list[bytes]]:
    """A chunk size and prompts that share prefixes (and repeat), as the memo meets them."""
    chunk_size = draw(st.sampled_from([1, 7, 256]))
    base = draw(st.lists(st.integers(0, 2**32 - 1), min_size=chunk_size, max_size=6 * chunk_size))
    out = []
    for _ in range(draw(st.integers(1, 12))):
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, 50), max_size=2 * chunk_size))
        out.append(raw(base[:cut] + tail))
    return chunk_size, out


@given(case=prompts(), sets=st.sampled_from([1, 2, 64]), repeat=st.integers(1, 3))
@settings(max_examples=200, deadline=None)
def test_the_memo_never_changes_a_hash(
    any_module: ModuleType, case: tuple[int, list[bytes]], sets: int, repeat: int
) -> None:
    module = any_module
    chunk_size, bodies = case
    memo = memo_of(module, chunk_size, SET_BYTES[chunk_size] * sets)
    for _ in range(repeat):
        for body in bodies:
            want = keys._python_chain(body, chunk_size, PREFIX)
            assert module.chain(body, chunk_size, PREFIX, memo) == want
    stats = memo.stats()
    assert stats["links"] == 4 * sets
    assert stats["hits"] + stats["misses"] == repeat * sum(
        len(b) // 4 // chunk_size for b in bodies
    )


def test_a_link_is_admitted_on_its_second_miss_and_found_after(module: ModuleType) -> None:
    memo = memo_of(module, 256, 1 << 20, COUNTING_SEED)
    body = raw(list(range(7, 7 + 256 * 10 + 5)))
    want = keys._python_chain(body, 256, PREFIX)
    for calls, (hits, misses) in enumerate([(0, 10), (0, 20), (10, 20), (20, 20)], 1):
        assert module.chain(body, 256, PREFIX, memo) == want
        stats = memo.stats()
        assert (stats["hits"], stats["misses"], stats["busy"]) == (hits, misses, 0), calls
    # Another prompt with the same first 4 chunks: those are found, the rest missed.
    other = raw(list(range(7, 7 + 256 * 4)) + [1] * 256 * 3)
    assert module.chain(other, 256, PREFIX, memo) == keys._python_chain(other, 256, PREFIX)
    assert memo.stats()["hits"] == 24
    memo.clear()
    assert module.chain(body, 256, PREFIX, memo) == want
    assert memo.stats()["hits"] == 24  # forgotten: missed again


def test_links_whose_tags_collide_are_told_apart_by_their_bytes(
    colliding_module: ModuleType,
) -> None:
    """One set of four links whose tags are all equal: the memo still finds each link's
    own hash (it would answer another link's if it trusted the tag)."""
    memo = memo_of(colliding_module, 256, SET_BYTES[256])
    prompts = [raw(list(range(k, k + 512))) for k in (0, 1000)]
    for _ in range(4):
        for body in prompts:
            want = keys._python_chain(body, 256, PREFIX)
            assert colliding_module.chain(body, 256, PREFIX, memo) == want
    assert memo.stats()["hits"] > 0


def test_only_links_with_a_32_byte_parent_go_through_it(module: ModuleType) -> None:
    memo = memo_of(module, 2, 1 << 16)
    body = raw([1, 2, 3, 4, 5, 6])
    for prefix in (b"", b"x" * 33):
        for _ in range(3):
            assert module.chain(body, 2, prefix, memo) == keys._python_chain(body, 2, prefix)
    # The first link of each call (its parent is the prefix) is hashed, not looked for.
    stats = memo.stats()
    assert stats["hits"] + stats["misses"] == 2 * 3 * 2


def test_identical_chunks_in_one_prompt_are_distinct_links(any_module: ModuleType) -> None:
    """A prompt of one repeated chunk: every link has the same tokens, another parent."""
    module = any_module
    memo = memo_of(module, 256, SET_BYTES[256])  # one set: they all compete for it
    body = raw([0] * 256 * 9)
    want = keys._python_chain(body, 256, PREFIX)
    for _ in range(4):
        assert module.chain(body, 256, PREFIX, memo) == want


def test_a_big_chain_without_the_gil_and_small_ones_beside_it(any_module: ModuleType) -> None:
    """Over 1 MiB of tokens the chain runs without the GIL, holding the memo; chains on
    other threads meanwhile hash without it (busy) or through it, and all are right."""
    module = any_module
    memo = memo_of(module, 256, 8 << 20)
    big = raw(np.random.default_rng(1).integers(0, 2**32, 256 * 1100, dtype=np.uint64))
    small = [raw(list(range(k, k + 256 * 8))) for k in range(4)]
    want_big = keys._python_chain(big, 256, PREFIX)
    want_small = [keys._python_chain(b, 256, PREFIX) for b in small]
    errors: list[str] = []

    def big_chains() -> None:
        for _ in range(3):
            if module.chain(big, 256, PREFIX, memo) != want_big:
                errors.append("big")

    def small_chains() -> None:
        for _ in range(200):
            for body, want in zip(small, want_small, strict=True):
                if module.chain(body, 256, PREFIX, memo) != want:
                    errors.append("small")

    threads = [threading.Thread(target=big_chains), threading.Thread(target=small_chains)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = memo.stats()
    # Every link of every call went through the memo, or its call found it busy (only
    # the small ones can: the big one takes it while it still holds the GIL).
    assert stats["hits"] + stats["misses"] + 8 * stats["busy"] == 3 * 1100 + 200 * 4 * 8


def test_the_memo_checks_its_arguments(module: ModuleType) -> None:
    with pytest.raises(ValueError, match="at least 4416 bytes"):
        module.ChainMemo(256, 4415, os.urandom(32))
    with pytest.raises(ValueError, match="32 bytes"):
        module.ChainMemo(256, 1 << 20, b"short")
    with pytest.raises(ValueError, match="chunk size"):
        module.ChainMemo(0, 1 << 20, os.urandom(32))
    memo = memo_of(module, 256, 1 << 20)
    assert memo.chunk_size == 256
    with pytest.raises(ValueError, match="links of 256 tokens, not 128"):
        module.chain(b"\0" * 1024, 128, PREFIX, memo)
    with pytest.raises(TypeError, match="ChainMemo"):
        module.chain(b"\0" * 1024, 256, PREFIX, object())
    # The largest power of two of sets that fits.
    assert memo_of(module, 256, SET_BYTES[256] * 5).stats()["links"] == 16


def test_chain_memo_and_chunk_hash_blob(module: ModuleType) -> None:
    if "compiled" not in keys.CHAINS:
        pytest.skip("keys.chain_memo serves the installed compiled chain, not built here")
    assert chain_memo(256, 0, os.urandom(32)) is None
    with pytest.raises(InvalidInput, match="at least"):
        chain_memo(256, 100, os.urandom(32))
    memo = chain_memo(256, 1 << 20, os.urandom(32))
    assert memo is not None
    tokens = list(range(3000))
    want = chunk_hash_blob(tokens, 256, chain=keys.CHAINS["python"])
    for _ in range(3):
        assert chunk_hash_blob(tokens, 256, memo=memo) == want
        assert b"".join(keys.chunk_hashes(tokens, 256, memo=memo)) == want
    assert memo.stats()["hits"] > 0
    with pytest.raises(InvalidInput, match="256-token links, not 128"):
        chunk_hash_blob(tokens, 128, ChunkHash(PREFIX), memo=memo)
