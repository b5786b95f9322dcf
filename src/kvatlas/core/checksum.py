"""Chunk checksums: xxh3-64 over the chunk's bytes.

Owns the one checksum every tier and every peer agrees on (L1 commit, L2 files, P2P
reads). xxh3 is a pure computation (~10+ GB/s), so it lives in the core; this module must
not read files or buffers it was not handed.
"""

from __future__ import annotations

from typing import Final

import xxhash

CHECKSUM_ALGORITHM: Final = "xxh3_64"

Buffer = bytes | bytearray | memoryview


def checksum(data: Buffer) -> int:
    """The xxh3-64 digest of ``data`` as an unsigned 64-bit int."""
    result: int = xxhash.xxh3_64_intdigest(data)
    return result
