"""The compiled blake3 prefix chain (`kvatlas.core._chain`) against the Python loop.

Property: for any tokens, chunk size and prefix, the compiled chain (the installed one,
or else built here from the BLAKE3 C sources as `pip install` builds it: conftest.py) and
`keys._python_chain` give the same bytes, and `chunk_hash_blob` refuses the same bad
input with either. The golden vectors of tests/core/test_keys.py hold whichever chain
`chunk_hashes` uses.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.core import keys
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import (
    CHAINS,
    MAX_TOKEN_ID,
    NONE_HASH,
    ChainHasher,
    chunk_hash_blob,
    chunk_hashes,
)
from kvatlas.core.types import ChunkHash


@pytest.fixture(scope="session")
def compiled(compiled_module: ModuleType) -> ChainHasher:
    chain: ChainHasher = compiled_module.chain
    return chain


token_st = st.one_of(st.integers(0, MAX_TOKEN_ID), st.integers(0, 300))


@given(
    tokens=st.lists(token_st, max_size=600),
    chunk_size=st.sampled_from([1, 2, 3, 7, 16, 64, 255, 256, 257, 1024, 1500]),
    prefix=st.one_of(st.just(bytes(NONE_HASH)), st.binary(max_size=80)),
)
@settings(max_examples=300, deadline=None)
def test_compiled_chain_gives_the_python_chain_bytes(
    compiled: ChainHasher, tokens: list[int], chunk_size: int, prefix: bytes
) -> None:
    """Chunk sizes over the C side's 1,024-token block included; any prefix length."""
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    want = keys._python_chain(raw, chunk_size, prefix)
    assert compiled(raw, chunk_size, prefix) == want
    assert len(want) == 32 * (len(tokens) // chunk_size)
    got = chunk_hash_blob(tokens, chunk_size, ChunkHash(prefix), chain=compiled)
    assert got == want


def test_a_32k_prompt_and_every_input_form(compiled: ChainHasher) -> None:
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 2**32, 32_768)]
    want = chunk_hash_blob(tokens, chain=CHAINS["python"])
    arr = np.asarray(tokens, dtype=np.uint32)
    for form in (tokens, arr, arr.astype(">u4"), arr[::-1][::-1], arr.tobytes()):
        assert chunk_hash_blob(form, chain=compiled) == want
    assert b"".join(chunk_hashes(tokens)) == want  # whichever chain is the default
    # A non-contiguous view is made contiguous first.
    wide = np.repeat(arr, 2)[::2]
    assert not wide.flags.c_contiguous
    assert chunk_hash_blob(wide, chain=compiled) == want


@pytest.mark.parametrize("name", ["python", "compiled"])
@pytest.mark.parametrize(
    ("tokens", "chunk_size"),
    [([-1] * 256, 256), ([2**32] * 256, 256), (["x"] * 256, 256), ([1] * 256, 0), (b"\0" * 5, 1)],
)
def test_bad_input_is_refused_alike(
    compiled: ChainHasher, name: str, tokens: list[object] | bytes, chunk_size: int
) -> None:
    chain = compiled if name == "compiled" else CHAINS["python"]
    with pytest.raises(InvalidInput):
        chunk_hash_blob(tokens, chunk_size, chain=chain)  # type: ignore[arg-type]


def test_the_compiled_chain_checks_its_own_arguments(compiled: ChainHasher) -> None:
    with pytest.raises(ValueError, match="positive"):
        compiled(b"\0" * 8, 0, b"")
    with pytest.raises(ValueError, match="whole"):
        compiled(b"\0" * 7, 1, b"")
    with pytest.raises(TypeError):
        compiled("text", 1, b"")  # type: ignore[arg-type]
    assert compiled(b"\0" * 4, 2, b"") == b""
