"""The lmcache-driven CUDA path's copy logic on CPU tensors (against the numpy path on
the same bytes), and, where a GPU is present, its CUDA IPC opening and events."""

from __future__ import annotations

import json
import sys
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from kvatlas.server.lmcache_mp.cpu_kv import CpuPagedKV
from kvatlas.server.lmcache_mp.cuda_kv import CudaPagedKV, TorchPagedKV
from kvatlas.server.lmcache_mp.wire import IpcDescriptor, TensorMetadata
from support.launch import launch

NB, BS, NH, HS, CHUNK = 8, 4, 2, 3, 8


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_torch_and_numpy_paths_write_the_same_chunk_bytes(layout: str) -> None:
    shape = (2, NB, BS, NH, HS) if layout == "NHD" else (2, NB, NH, BS, HS)
    shm = shared_memory.SharedMemory(create=True, size=2 * NB * BS * NH * HS * 4)
    try:
        arr = np.ndarray(shape, np.float32, buffer=shm.buf)
        arr[:] = np.random.default_rng(3).random(shape, dtype=np.float32)
        strides = [s // 4 for s in arr.strides]
        meta = TensorMetadata("float32", list(shape), strides, 0, "cpu")
        np_kv = CpuPagedKV([IpcDescriptor("cpu_shm", 1, meta, shm.name, shm.size)], CHUNK, layout)
        t_kv = TorchPagedKV([torch.from_numpy(arr.copy())], CHUNK, layout)
        a, b = bytearray(np_kv.geometry.nbytes), bytearray(t_kv.geometry.nbytes)
        np_kv.gather([3, 5], 0, memoryview(a))
        t_kv.gather([3, 5], 0, memoryview(b))
        assert a == b
        t_kv.scatter([6, 1], 0, memoryview(b), skip_blocks=1)
        back = bytearray(len(b))
        t_kv.gather([3, 1], 0, memoryview(back))  # block 1 now holds block 5's KV
        assert back == b
        t_kv.gather([6, 5], 0, memoryview(back))  # block 6 was skipped: unchanged
        assert back != b
        for layerwise in (False, True):  # LMCache's /cache/checksums digests, both paths
            ids = [7, 0, 2, 6, 4]  # not block 1, which the scatter above rewrote
            assert t_kv.checksums(ids, 2, layerwise) == np_kv.checksums(ids, 2, layerwise)
        t_bf = TorchPagedKV([torch.from_numpy(arr.copy()).to(torch.bfloat16)], CHUNK, layout)
        widened = TorchPagedKV(
            [torch.from_numpy(arr.copy()).to(torch.bfloat16).float()], CHUNK, layout
        )
        assert t_bf.checksums([1, 2, 3], 2, False) == widened.checksums([1, 2, 3], 2, False)
        np_kv.close()
        del arr
    finally:
        shm.close()
        shm.unlink()


_EXPORTER = """
import json, sys, torch
kv = torch.arange(2 * 8 * 4 * 2 * 3, dtype=torch.float32, device="cuda").reshape(2, 8, 4, 2, 3)
storage = kv.untyped_storage()
handle = storage._share_cuda_()
print(json.dumps({
    "handle": [h.hex() if isinstance(h, bytes) else h for h in handle],
    "uuid": str(torch.cuda.get_device_properties(kv.device.index).uuid),
}), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the CUDA IPC path is exercised on a machine with a GPU",
)
def test_cuda_ipc_handles_open_and_gather() -> None:
    child = launch([sys.executable, "-c", _EXPORTER], name="cuda-exporter", pipes=True)
    try:
        assert child.popen.stdout is not None
        out = json.loads(child.popen.stdout.readline())
        handle = [bytes.fromhex(h) if isinstance(h, str) else h for h in out["handle"]]
        meta = TensorMetadata("float32", [2, 8, 4, 2, 3], [192, 24, 6, 3, 1], 0, out["uuid"])
        desc = IpcDescriptor("cuda", 1, meta, raw={"type": "cuda", "handle": handle})
        kv = CudaPagedKV([desc], CHUNK, "NHD")
        buf = bytearray(kv.geometry.nbytes)
        kv.begin(b"")
        kv.gather([2, 3], 0, memoryview(buf))
        assert kv.end() == b""
        want = torch.arange(2 * 8 * 4 * 2 * 3, dtype=torch.float32).reshape(2, 8, 4, 2, 3)
        chunk = want[:, [2, 3]].reshape(2, 1, CHUNK, 6)
        assert bytes(buf) == chunk.numpy().tobytes()
        kv.close()
    finally:
        if child.popen.stdin is not None:
            child.popen.stdin.close()  # the exporter's signal to leave
        child.wait_exit(30)
        child.stop()
