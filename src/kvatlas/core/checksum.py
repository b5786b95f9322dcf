"""Chunk checksums: xxh3-64 over the chunk's bytes.

Owns the one checksum every tier and every peer agrees on (L1 commit, L2 files, P2P
reads, engine copies), in its three forms: one-shot (`checksum`), streaming
(`checksum_stream`, for bytes that arrive in pieces) and fused with a copy
(`copy_and_checksum`). xxh3 is a pure computation (no I/O), so it lives in the core;
this module must not read files or buffers it was not handed.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

CHECKSUM_ALGORITHM: Final = "xxh3_64"

COPY_BLOCK_BYTES: Final = 512 * 1024
"""Copy and hash in blocks that stay in the CPU cache: the checksum then reads the block
just written instead of making a second pass over memory."""

Buffer = bytes | bytearray | memoryview


def checksum(data: Buffer) -> int:
    """The xxh3-64 digest of ``data`` as an unsigned 64-bit int."""
    result: int = xxhash.xxh3_64_intdigest(data)
    return result


def checksum_stream() -> xxhash.xxh3_64:
    """A streaming hasher whose ``intdigest()`` equals `checksum` of all it was fed."""
    return xxhash.xxh3_64()


def copy_and_checksum(src: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8]) -> int:
    """``np.copyto(dst, src)`` and the checksum of the bytes copied, in one pass."""
    if src.size <= COPY_BLOCK_BYTES:
        np.copyto(dst, src)
        return checksum(dst.data)
    h = checksum_stream()
    for off in range(0, src.size, COPY_BLOCK_BYTES):
        block = dst[off : off + COPY_BLOCK_BYTES]
        np.copyto(block, src[off : off + COPY_BLOCK_BYTES])
        h.update(block.data)
    return int(h.intdigest())
