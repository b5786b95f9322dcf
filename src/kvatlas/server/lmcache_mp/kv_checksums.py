"""MD5 digests of a worker's paged KV blocks, as LMCache 0.5.6's ``POST /cache/checksums``
computes them.

LMCache's own tools (``lmcache bench server`` in lmcache-driven mode) check that a
retrieve wrote back what a store read by asking the server to hash the worker's KV
blocks before and after. The digest is LMCache's: each layer's blocks are selected along
its block axis, a chunk is ``chunk_blocks`` consecutive selected blocks, and one MD5
covers every layer's bytes of the chunk in layer order (``layerwise``: one MD5 per layer
and chunk). Bytes are the selected sub-tensor's in C order; bfloat16 is widened to
float32 first, as LMCache's server does. The last chunk may be short.

Pure numpy over the blocks a ``PagedKV`` picks (``cpu_kv`` from its mapping, ``cuda_kv``
copied to the host), one chunk of one layer at a time. Must not: map, open or keep KV
memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

Digests = list[str] | dict[str, list[str]]
"""A digest per chunk; layerwise, ``{"layer_<i>": [digest per chunk]}``."""


def compress_ranges(ids: Sequence[int]) -> list[int | list[int]]:
    """LMCache's ``compress_slot_mapping``: runs of three or more consecutive ids become
    ``[first, last]``, order kept: ``[1, 2, 3, 4, 5, 7, 8]`` -> ``[[1, 5], 7, 8]``."""
    out: list[int | list[int]] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        if j - i >= 2:
            out.append([ids[i], ids[j]])
        else:
            out.extend(ids[i : j + 1])
        i = j + 1
    return out


Pick = Callable[[int, npt.NDArray[np.intp]], npt.NDArray[np.generic]]
"""(layer, block ids) -> that layer's blocks at those ids, on its block axis, as a new
C-order host array (bfloat16 carried as uint16)."""


def _widened(blocks: npt.NDArray[np.generic], dtype: str) -> npt.NDArray[np.generic]:
    """bfloat16 (carried as uint16) as float32's bits; any other dtype as it is."""
    if dtype != "bfloat16":
        return blocks
    return blocks.view(np.uint16).astype(np.uint32) << np.uint32(16)


def block_checksums(
    pick: Pick,
    layers: int,
    dtype: str,
    block_ids: Sequence[int],
    *,
    chunk_blocks: int,
    layerwise: bool,
) -> Digests:
    """The digests of ``block_ids`` over ``layers`` layers, ``chunk_blocks`` blocks a
    chunk; ids must be valid (the caller checks). One chunk of one layer is in memory at
    a time, whatever the number of ids asked for."""
    idx = np.asarray(block_ids, dtype=np.intp)
    chunks = [idx[s : s + chunk_blocks] for s in range(0, len(idx), chunk_blocks)]

    def chunk_bytes(layer: int, ids: npt.NDArray[np.intp]) -> bytes:
        return _widened(pick(layer, ids), dtype).tobytes()

    if layerwise:
        return {
            f"layer_{li}": [
                hashlib.md5(chunk_bytes(li, ids), usedforsecurity=False).hexdigest()
                for ids in chunks
            ]
            for li in range(layers)
        }
    out: list[str] = []
    for ids in chunks:
        md5 = hashlib.md5(usedforsecurity=False)
        for li in range(layers):
            md5.update(chunk_bytes(li, ids))
        out.append(md5.hexdigest())
    return out
