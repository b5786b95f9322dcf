"""A worker's paged KV cache in POSIX shared memory, mapped by the server (lmcache-driven).

In LMCache's lmcache-driven mode on CPU, the worker moves each layer's KV tensor into a
POSIX shared-memory segment (``CpuShmTensorWrapper``) and registers the descriptors; the
server maps the same pages and copies between the paged blocks and its chunk objects
itself. This module maps those descriptors with numpy (no torch in the server) and
gathers/scatters one chunk at a time.

Layouts served, per layer, as vLLM allocates them: K/V first ``[2, num_blocks, ...]``
or blocks first ``[num_blocks, 2, ...]`` (chosen when the first dimension is not 2),
each with the last three axes ``[heads, block_size, head_size]`` ("HND", the CPU
attention backend's, and LMCache's default for CPU tensors without a hint) or
``[block_size, heads, head_size]`` ("NHD"), as the registration's ``kv_layout`` layout
hint says. A chunk is ``[2, num_layers, chunk_tokens, num_heads *
head_size]`` in the KV dtype, the same bytes LMCache's engine-driven worker writes
(``gather_paged_kv_to_cpu``), so a chunk stored in one mode is retrieved in the other.

Must not: decide which chunks to move (``service``), or keep a mapping past
``close`` (the worker may unlink the segment once it unregisters).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from kvatlas.core.errors import InvalidInput
from kvatlas.server.lmcache_mp.kv_checksums import Digests, block_checksums
from kvatlas.server.lmcache_mp.wire import IpcDescriptor

ITEMSIZES: Final = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}
"""KV dtypes by their torch names; bytes move as unsigned ints of the same width."""
NULL_BLOCK_ID: Final = 0
"""The block id that holds no KV: vLLM's null block, which hybrid models' sliding-window
and recurrent groups name for the blocks they dropped. LMCache 0.5.7 tells engine-driven
workers so at registration (``null_block_id``, its server's default 0) and both modes
skip it: a chunk of null blocks only is not stored, and a retrieve never writes into the
null block."""
_UINT: Final = {1: np.uint8, 2: np.uint16, 4: np.uint32}
SHM_DIR: Final = "/dev/shm"


def _shm_path(name: str) -> str:
    base = name.lstrip("/")
    if not base or "/" in base or base in (".", ".."):
        raise InvalidInput(f"shared-memory name {name!r} is not a POSIX SHM name")
    return os.path.join(SHM_DIR, base)


@dataclass(frozen=True, slots=True)
class ChunkGeometry:
    """What one chunk object holds: ``[2, layers, tokens, hidden]`` (``[layers, tokens,
    hidden]`` for single-plane formats) of ``dtype``."""

    layers: int
    tokens: int
    hidden: int
    dtype: str
    planes: int = 2

    @property
    def shape(self) -> list[int]:
        if self.planes == 1:
            return [self.layers, self.tokens, self.hidden]
        return [2, self.layers, self.tokens, self.hidden]

    @property
    def nbytes(self) -> int:
        return self.planes * self.layers * self.tokens * self.hidden * ITEMSIZES[self.dtype]


def check_block_ids(block_ids: Sequence[int], num_blocks: int) -> None:
    """InvalidInput naming the first id outside ``[0, num_blocks)``."""
    bad = next((b for b in block_ids if not 0 <= b < num_blocks), None)
    if bad is not None:
        raise InvalidInput(f"block id {bad} is outside the worker's {num_blocks} KV blocks")


class PagedKV(Protocol):
    """A registered worker's paged KV, as ``service`` copies chunks in and out of it:
    ``CpuPagedKV`` here, ``cuda_kv.CudaPagedKV`` for CUDA IPC handles."""

    geometry: ChunkGeometry
    block_size: int
    blocks_per_chunk: int

    def gather(self, block_ids: Sequence[int], index: int, out: memoryview) -> None: ...

    def scatter(
        self, block_ids: Sequence[int], index: int, src: memoryview, skip_blocks: int = 0
    ) -> None: ...

    def checksums(self, block_ids: Sequence[int], chunk_blocks: int, layerwise: bool) -> Digests:
        """LMCache's ``/cache/checksums`` digests of ``block_ids`` (``kv_checksums``)."""
        ...

    def begin(self, event_handle: bytes) -> None:
        """Order the copies after the worker's event."""
        ...

    def end(self) -> bytes:
        """Wait for the copies; the event handle to answer with."""
        ...

    def close(self) -> None: ...


class CpuPagedKV:
    """The mapped layers of one registered worker; ``close`` unmaps them."""

    def __init__(
        self, descriptors: Sequence[IpcDescriptor], chunk_size: int, kv_layout: str = "HND"
    ) -> None:
        if kv_layout not in ("HND", "NHD"):
            raise InvalidInput(f"kv_layout hint {kv_layout!r}: HND and NHD are served")
        self._hnd = kv_layout == "HND"
        if not descriptors:
            raise InvalidInput("register_kv_cache carried no KV tensors")
        self._maps: list[mmap.mmap] = []
        layers: list[npt.NDArray[np.generic]] = []
        try:
            for i, desc in enumerate(descriptors):
                layers.append(self._map(i, desc))
        except BaseException:
            self.close()
            raise
        dtypes = {d.metadata.dtype for d in descriptors if d.metadata is not None}
        shapes = {tuple(a.shape) for a in layers}
        if len(dtypes) != 1 or len(shapes) != 1:
            raise InvalidInput(f"KV layers differ: dtypes {dtypes}, shapes {shapes}")
        shape = shapes.pop()
        if len(shape) != 5 or 2 not in shape[:2]:
            raise InvalidInput(
                f"KV layer shape {list(shape)} is not [2, blocks, block_size, heads, head_size]"
                " or [blocks, 2, block_size, heads, head_size]"
            )
        # [2, NB, BS, NH, HS] unless the first dimension cannot be K/V.
        self._kv_first = shape[0] == 2
        nb, d2, d3, hs = shape[1:] if self._kv_first else (shape[0], *shape[2:])
        nh, bs = (d2, d3) if self._hnd else (d3, d2)
        if chunk_size % bs:
            raise InvalidInput(f"chunk size {chunk_size} is not a multiple of block size {bs}")
        self._heads = nh
        self.num_blocks = nb
        self.block_size = bs
        self.blocks_per_chunk = chunk_size // bs
        self._layers = layers
        self.geometry = ChunkGeometry(len(layers), chunk_size, nh * hs, dtypes.pop())

    def _map(self, i: int, desc: IpcDescriptor) -> npt.NDArray[np.generic]:
        meta = desc.metadata
        if desc.type != "cpu_shm" or meta is None:
            raise InvalidInput(f"KV tensor {i} is a {desc.type!r} handle, not cpu_shm")
        size = ITEMSIZES.get(meta.dtype)
        if size is None:
            raise InvalidInput(f"KV dtype {meta.dtype!r} is not one of {sorted(ITEMSIZES)}")
        if len(meta.shape) != len(meta.stride):
            raise InvalidInput(f"KV tensor {i}: shape and stride ranks differ")
        span = size * (
            meta.storage_offset
            + 1
            + sum((n - 1) * s for n, s in zip(meta.shape, meta.stride, strict=True))
        )
        if 0 in meta.shape or span > desc.nbytes:
            raise InvalidInput(f"KV tensor {i}: its view does not fit its {desc.nbytes} bytes")
        path = _shm_path(desc.shm_name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise InvalidInput(f"cannot open the worker's KV segment {path}: {exc}") from exc
        try:
            if os.fstat(fd).st_size < desc.nbytes:
                raise InvalidInput(f"the worker's KV segment {path} is under {desc.nbytes} bytes")
            mapping = mmap.mmap(fd, desc.nbytes)
        finally:
            os.close(fd)
        self._maps.append(mapping)
        flat = np.frombuffer(mapping, dtype=_UINT[size])
        return np.lib.stride_tricks.as_strided(
            flat[meta.storage_offset :],
            shape=tuple(meta.shape),
            strides=tuple(s * size for s in meta.stride),
        )

    def _chunk_blocks(self, block_ids: Sequence[int], index: int) -> list[int]:
        bpc = self.blocks_per_chunk
        blocks = list(block_ids[index * bpc : (index + 1) * bpc])
        if len(blocks) != bpc or any(not 0 <= b < self.num_blocks for b in blocks):
            raise InvalidInput(
                f"chunk {index} needs {bpc} block ids in [0, {self.num_blocks}), got {blocks}"
            )
        return blocks

    def _kv(self, layer: int, blocks: list[int]) -> npt.NDArray[np.generic]:
        """``[2, bpc, BS, NH, HS]`` of ``layer`` at ``blocks`` (a copy)."""
        a = self._layers[layer]
        kv = a[:, blocks] if self._kv_first else np.moveaxis(a[blocks], 1, 0)
        return np.swapaxes(kv, 2, 3) if self._hnd else kv

    def gather(self, block_ids: Sequence[int], index: int, out: memoryview) -> None:
        """Chunk ``index`` of ``block_ids`` into ``out`` (``geometry.nbytes`` bytes)."""
        g = self.geometry
        blocks = self._chunk_blocks(block_ids, index)
        dst = np.frombuffer(out, dtype=self._layers[0].dtype).reshape(2, g.layers, g.tokens, -1)
        for layer in range(g.layers):
            dst[:, layer] = self._kv(layer, blocks).reshape(2, g.tokens, g.hidden)

    def scatter(
        self, block_ids: Sequence[int], index: int, src: memoryview, skip_blocks: int = 0
    ) -> None:
        """Chunk ``src`` into chunk ``index`` of ``block_ids``, leaving the first
        ``skip_blocks`` blocks of it and any null block untouched."""
        g = self.geometry
        blocks = self._chunk_blocks(block_ids, index)
        data = np.frombuffer(src, dtype=self._layers[0].dtype).reshape(
            2, g.layers, self.blocks_per_chunk, self.block_size, -1
        )
        for layer in range(g.layers):
            a = self._layers[layer]
            for j in range(skip_blocks, len(blocks)):
                if blocks[j] == NULL_BLOCK_ID:
                    continue
                kv = data[:, layer, j].reshape(2, self.block_size, self._heads, -1)
                if self._hnd:
                    kv = np.swapaxes(kv, 1, 2)
                if self._kv_first:
                    a[:, blocks[j]] = kv
                else:
                    a[blocks[j]] = kv

    def checksums(self, block_ids: Sequence[int], chunk_blocks: int, layerwise: bool) -> Digests:
        """LMCache's ``/cache/checksums`` digests of ``block_ids`` (``kv_checksums``)."""
        check_block_ids(block_ids, self.num_blocks)
        axis = 1 if self._kv_first else 0
        return block_checksums(
            lambda layer, ids: np.take(self._layers[layer], ids, axis=axis),
            len(self._layers),
            self.geometry.dtype,
            block_ids,
            chunk_blocks=chunk_blocks,
            layerwise=layerwise,
        )

    def begin(self, event_handle: bytes) -> None:
        """CPU copies are synchronous: a worker's CPU event is recorded already."""

    def end(self) -> bytes:
        """Nothing pending: an empty event handle."""
        return b""

    def close(self) -> None:
        self._layers = []
        for m in self._maps:
            # a view still exported keeps its mapping until it is collected
            with contextlib.suppress(BufferError):
                m.close()
        self._maps.clear()
