"""The chunk checksum in its three forms gives one digest."""

from __future__ import annotations

import numpy as np
import pytest

from kvatlas.core.checksum import (
    COPY_BLOCK_BYTES,
    checksum,
    checksum_stream,
    copy_and_checksum,
)

SIZES = [1, 4096, COPY_BLOCK_BYTES, COPY_BLOCK_BYTES + 1, 3 * 1024 * 1024 + 17]


@pytest.mark.parametrize("size", SIZES)
def test_fused_copy_equals_the_one_shot_checksum_and_copies(size: int) -> None:
    src = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    assert copy_and_checksum(src, dst) == checksum(src.data)
    assert np.array_equal(src, dst)


def test_stream_in_uneven_pieces_equals_the_one_shot_checksum() -> None:
    data = np.random.default_rng(3).bytes(3 * 256 * 1024 + 17)
    hasher = checksum_stream()
    for k in range(0, len(data), 65_536 + 3):
        hasher.update(data[k : k + 65_536 + 3])
    assert hasher.intdigest() == checksum(data)
    assert checksum(data) != checksum(data[:-1] + bytes([data[-1] ^ 1]))
