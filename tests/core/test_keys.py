"""Keys: golden vectors of the blake3 prefix chain, kv-rank packing, hash contracts."""

from __future__ import annotations

import numpy as np
import pytest
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st

from kvatlas.core.errors import ContractMismatch, InvalidInput
from kvatlas.core.keys import (
    NONE_HASH,
    HashContract,
    ObjectKey,
    as_token_array,
    chunk_hashes,
    default_kv_rank,
    pack_kv_rank,
    unpack_kv_rank,
)

# Computed by an independent implementation of the same scheme.
GOLDEN_TWO_CHUNKS = [
    "084547b6c40ed5b05ba8cd0305db5bf74d5617673948d9ed193ab7d6cbc484d4",
    "e5ffee45c2b9db326814c9692dc594369887ba3b0df5761817820b60f864c8e0",
]
GOLDEN_ONES = "1aba48f88227a4108ac116a95210aa28dbb81168ba3917338c4f1ddcf01c0852"


def test_golden_vectors_two_full_chunks_and_a_partial_one() -> None:
    tokens = list(range(512)) + [7] * 100
    assert [h.hex() for h in chunk_hashes(tokens)] == GOLDEN_TWO_CHUNKS


def test_golden_vector_one_chunk_of_ones() -> None:
    assert [h.hex() for h in chunk_hashes([1] * 256)] == [GOLDEN_ONES]


def test_all_input_forms_hash_alike() -> None:
    tokens = list(range(512)) + [7] * 100
    arr = np.asarray(tokens, dtype=np.uint32)
    le_bytes = arr.astype("<u4").tobytes()
    expect = chunk_hashes(tokens)
    assert chunk_hashes(arr) == expect
    assert chunk_hashes(arr.astype(np.int64)) == expect
    assert chunk_hashes(le_bytes) == expect


def _reference_chain(tokens: list[int], chunk_size: int) -> list[bytes]:
    """Straight from DESIGN.md, one chunk at a time."""
    prev = blake3((0).to_bytes(8, "big") + (0).to_bytes(4, "big")).digest()
    out = []
    for i in range(len(tokens) // chunk_size):
        chunk = tokens[i * chunk_size : (i + 1) * chunk_size]
        prev = blake3(prev + b"".join(t.to_bytes(4, "big") for t in chunk)).digest()
        out.append(prev)
    return out


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=80),
    st.integers(1, 16),
)
def test_chain_matches_reference(tokens: list[int], chunk_size: int) -> None:
    assert chunk_hashes(tokens, chunk_size) == _reference_chain(tokens, chunk_size)


def test_chain_continues_from_a_prefix() -> None:
    tokens = list(range(1024))
    full = chunk_hashes(tokens)
    assert chunk_hashes(tokens[512:], prefix=full[1]) == full[2:]
    assert chunk_hashes(tokens[:256], prefix=NONE_HASH) == full[:1]


def test_partial_chunk_has_no_key() -> None:
    assert chunk_hashes(list(range(255))) == []


@pytest.mark.parametrize("bad", [[-1], [2**32], ["x"]])
def test_bad_tokens_are_refused(bad: list[object]) -> None:
    with pytest.raises(InvalidInput):
        as_token_array(bad)  # type: ignore[arg-type]


def test_bad_chunk_size_and_odd_byte_count() -> None:
    with pytest.raises(InvalidInput):
        chunk_hashes([1, 2, 3], 0)
    with pytest.raises(InvalidInput):
        as_token_array(b"\x00\x01\x02")


def test_kv_rank_packing() -> None:
    assert default_kv_rank() == 16777472
    assert pack_kv_rank(8, 3, 4, 1) == 8 << 24 | 3 << 16 | 4 << 8 | 1
    assert unpack_kv_rank(pack_kv_rank(8, 3, 4, 1)) == (8, 3, 4, 1)
    with pytest.raises(InvalidInput, match="world_size"):
        pack_kv_rank(256, 0, 1, 0)


def test_object_key_namespace_and_hex() -> None:
    key = ObjectKey(b"\x01" * 32, "m", default_kv_rank(), 2, "salt")
    assert key.chunk_hash_hex == "01" * 32
    assert key.namespace.model_name == "m"
    assert key.namespace.object_group_id == 2


def test_contract_mismatch_names_the_field() -> None:
    fleet = HashContract("smollm2", 256, "blake3", "float32", (30, 3, 64), 1)
    assert fleet.mismatch(fleet) is None
    for field, other in [
        ("chunk_size", HashContract("smollm2", 128, "blake3", "float32", (30, 3, 64), 1)),
        ("kv_dtype", HashContract("smollm2", 256, "blake3", "bfloat16", (30, 3, 64), 1)),
        ("kv_layout", HashContract("smollm2", 256, "blake3", "float32", (30, 4, 64), 1)),
        ("world_size", HashContract("smollm2", 256, "blake3", "float32", (30, 3, 64), 2)),
        ("hash_algorithm", HashContract("smollm2", 256, "sha256", "float32", (30, 3, 64), 1)),
    ]:
        assert fleet.mismatch(other) == field
        with pytest.raises(ContractMismatch, match=field) as info:
            fleet.check_compatible(other)
        assert info.value.field == field
