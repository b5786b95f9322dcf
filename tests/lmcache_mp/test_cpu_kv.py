"""The server's view of a worker's paged KV in POSIX SHM: gather and scatter, both
layouts, against numpy's own indexing of the same bytes."""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

from kvatlas.core.errors import InvalidInput
from kvatlas.server.lmcache_mp.cpu_kv import CpuPagedKV
from kvatlas.server.lmcache_mp.wire import IpcDescriptor, TensorMetadata
from lmcache_mp.conftest import shm_segments

NB, BS, NH, HS, LAYERS, CHUNK = 8, 4, 2, 3, 2, 8


@pytest.fixture
def segments() -> Iterator[list[shared_memory.SharedMemory]]:
    with shm_segments(2, 2 * NB * BS * NH * HS * 4) as shms:
        yield shms


def desc(shm: shared_memory.SharedMemory, shape: tuple[int, ...]) -> IpcDescriptor:
    strides = np.empty(shape, dtype=np.float32).strides
    meta = TensorMetadata("float32", list(shape), [s // 4 for s in strides], 0, "cpu")
    return IpcDescriptor("cpu_shm", 1, meta, "/" + shm.name, shm.size)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gather_then_scatter_round_trip(
    segments: list[shared_memory.SharedMemory], layout: str
) -> None:
    shape = (2, NB, BS, NH, HS) if layout == "NHD" else (2, NB, NH, BS, HS)
    rng = np.random.default_rng(1)
    arrays = []
    for shm in segments:
        a = np.ndarray(shape, np.float32, buffer=shm.buf)
        a[:] = rng.random(shape, dtype=np.float32)
        arrays.append(a)
    kv = CpuPagedKV([desc(s, shape) for s in segments], CHUNK, layout)
    g = kv.geometry
    assert (g.layers, g.tokens, g.hidden, kv.blocks_per_chunk) == (LAYERS, CHUNK, NH * HS, 2)
    out = bytearray(g.nbytes)
    kv.gather([5, 1, 6, 2], 1, memoryview(out))  # chunk 1: blocks 6 and 2
    chunk = np.frombuffer(out, np.float32).reshape(2, LAYERS, CHUNK, NH * HS)
    for layer, a in enumerate(arrays):
        nhd = a if layout == "NHD" else np.swapaxes(a, 2, 3)  # [2, NB, BS, NH, HS]
        want = nhd[:, [6, 2]].reshape(2, CHUNK, NH * HS)
        assert np.array_equal(chunk[:, layer], want)
    before = [a.copy() for a in arrays]
    kv.scatter([7, 3], 0, memoryview(out), skip_blocks=1)  # block 7 kept, block 3 written
    for layer, (a, old) in enumerate(zip(arrays, before, strict=True)):
        nhd = a if layout == "NHD" else np.swapaxes(a, 2, 3)
        old_nhd = old if layout == "NHD" else np.swapaxes(old, 2, 3)
        assert np.array_equal(nhd[:, 7], old_nhd[:, 7])
        want = chunk[:, layer].reshape(2, 2, BS, NH, HS)[:, 1]
        assert np.array_equal(nhd[:, 3], want)
    del arrays, a, nhd, before, old, old_nhd
    kv.close()


def test_refuses_what_it_cannot_map(segments: list[shared_memory.SharedMemory]) -> None:
    shape = (2, NB, BS, NH, HS)
    with pytest.raises(InvalidInput, match="chunk size 6 is not a multiple of block size 4"):
        CpuPagedKV([desc(segments[0], shape)], 6, "NHD")
    big = IpcDescriptor("cpu_shm", 1, desc(segments[0], shape).metadata, "/" + segments[0].name, 10)
    with pytest.raises(InvalidInput, match="does not fit"):
        CpuPagedKV([big], CHUNK, "NHD")
    with pytest.raises(InvalidInput, match="not cpu_shm"):
        CpuPagedKV([IpcDescriptor("cuda", 1)], CHUNK, "NHD")
    with pytest.raises(InvalidInput, match="POSIX SHM name"):
        CpuPagedKV(
            [IpcDescriptor("cpu_shm", 1, desc(segments[0], shape).metadata, "/a/../b", 4096)], CHUNK
        )
    kv = CpuPagedKV([desc(segments[0], shape)], CHUNK, "NHD")
    with pytest.raises(InvalidInput, match="block ids"):
        kv.gather([0, 99], 0, memoryview(bytearray(kv.geometry.nbytes)))
    kv.close()
