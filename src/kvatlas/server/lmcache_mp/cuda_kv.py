"""A worker's paged KV on a GPU, opened from CUDA IPC handles (lmcache-driven, CUDA).

The only module of the server that imports torch: ``service`` imports it when a
``register_kv_cache`` with CUDA handles arrives, so a server that never sees one never
loads torch (``tests/cli/test_main.py`` checks what ``kvatlas server`` imports). Handles
of kind ``cuda`` (PyTorch's shared CUDA storage, LMCache's default ``CudaIPCWrapper``)
are opened with ``UntypedStorage._new_shared_cuda``; ``cuda_raw`` and ``cuda_vmm``
(LMCache's isolated-IPC and VMM policies) are refused with a message naming
engine-driven mode.

Copies run on a server stream that first waits on the worker's exported event (the
forward pass that wrote the KV); each store or retrieve synchronizes that stream before
it answers, so the answer's event handle is empty (LMCache's "no device work pending").
Chunk bytes are the CPU path's (``[2, layers, tokens, heads * head_size]``), so CUDA and
CPU workers, and engine-driven ones, share chunks. ``TorchPagedKV`` holds the
device-agnostic copy logic (tested on CPU tensors here); ``open_cuda`` and the events
need a GPU.

Must not: be imported at server start, or keep tensors past ``close``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvatlas.core.errors import InvalidInput
from kvatlas.server.lmcache_mp.cpu_kv import (
    ITEMSIZES,
    NULL_BLOCK_ID,
    ChunkGeometry,
    check_block_ids,
)
from kvatlas.server.lmcache_mp.kv_checksums import Digests, block_checksums
from kvatlas.server.lmcache_mp.wire import IpcDescriptor

_DTYPES = {name: getattr(torch, name) for name in ITEMSIZES}
_UINTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
"""Same-width integer views: numpy has no bfloat16 or float8."""


class TorchPagedKV:
    """Paged KV layers as torch tensors (any device); the same contract as
    ``cpu_kv.CpuPagedKV``: ``[2|blocks, ...]`` per layer, ``kv_layout`` HND or NHD."""

    def __init__(self, layers: Sequence[torch.Tensor], chunk_size: int, kv_layout: str) -> None:
        if not layers:
            raise InvalidInput("register_kv_cache carried no KV tensors")
        if kv_layout not in ("HND", "NHD"):
            raise InvalidInput(f"kv_layout hint {kv_layout!r}: HND and NHD are served")
        shapes = {tuple(t.shape) for t in layers}
        dtypes = {str(t.dtype).removeprefix("torch.") for t in layers}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise InvalidInput(f"KV layers differ: dtypes {dtypes}, shapes {shapes}")
        shape = shapes.pop()
        if len(shape) != 5 or 2 not in shape[:2]:
            raise InvalidInput(f"KV layer shape {list(shape)} is not a 5-D paged KV layout")
        self._hnd = kv_layout == "HND"
        self._kv_first = shape[0] == 2
        nb, d2, d3, hs = shape[1:] if self._kv_first else (shape[0], *shape[2:])
        nh, bs = (d2, d3) if self._hnd else (d3, d2)
        if chunk_size % bs:
            raise InvalidInput(f"chunk size {chunk_size} is not a multiple of block size {bs}")
        dtype = dtypes.pop()
        if dtype not in ITEMSIZES:
            raise InvalidInput(f"KV dtype {dtype!r} is not one of {sorted(ITEMSIZES)}")
        self._layers = list(layers)
        self._heads = nh
        self.num_blocks = nb
        self.block_size = bs
        self.blocks_per_chunk = chunk_size // bs
        self.geometry = ChunkGeometry(len(layers), chunk_size, nh * hs, dtype)
        self.device = layers[0].device

    def _blocks(self, block_ids: Sequence[int], index: int) -> list[int]:
        bpc = self.blocks_per_chunk
        blocks = list(block_ids[index * bpc : (index + 1) * bpc])
        if len(blocks) != bpc or any(not 0 <= b < self.num_blocks for b in blocks):
            raise InvalidInput(
                f"chunk {index} needs {bpc} block ids in [0, {self.num_blocks}), got {blocks}"
            )
        return blocks

    def _nhd(self, layer: int) -> torch.Tensor:
        """``layer`` as ``[2, blocks, block_size, heads, head_size]`` (a view)."""
        a = self._layers[layer]
        kv = a if self._kv_first else a.movedim(1, 0)
        return kv.transpose(2, 3) if self._hnd else kv

    def chunk(self, block_ids: Sequence[int], index: int) -> torch.Tensor:
        """Chunk ``index`` as ``[2, layers, tokens, hidden]`` on the KV's device."""
        g = self.geometry
        idx = torch.tensor(self._blocks(block_ids, index), device=self.device)
        return torch.stack(
            [
                self._nhd(layer).index_select(1, idx).reshape(2, g.tokens, g.hidden)
                for layer in range(g.layers)
            ],
            dim=1,
        )

    def gather(self, block_ids: Sequence[int], index: int, out: memoryview) -> None:
        g = self.geometry
        dst = torch.frombuffer(out, dtype=_DTYPES[g.dtype]).view(2, g.layers, g.tokens, g.hidden)
        dst.copy_(self.chunk(block_ids, index))

    def scatter(
        self, block_ids: Sequence[int], index: int, src: memoryview, skip_blocks: int = 0
    ) -> None:
        g = self.geometry
        blocks = self._blocks(block_ids, index)
        data = torch.frombuffer(src, dtype=_DTYPES[g.dtype]).view(
            2, g.layers, self.blocks_per_chunk, self.block_size, self._heads, -1
        )
        data = data.to(self.device)
        for layer in range(g.layers):
            nhd = self._nhd(layer)
            for j in range(skip_blocks, len(blocks)):
                if blocks[j] != NULL_BLOCK_ID:
                    nhd[:, blocks[j]] = data[:, layer, j]

    def checksums(self, block_ids: Sequence[int], chunk_blocks: int, layerwise: bool) -> Digests:
        """LMCache's ``/cache/checksums`` digests of ``block_ids``: each chunk's blocks
        of each layer are copied to the host, then hashed as the CPU path hashes them."""
        check_block_ids(block_ids, self.num_blocks)
        axis = 1 if self._kv_first else 0
        width = _UINTS[ITEMSIZES[self.geometry.dtype]]

        def pick(layer: int, ids: npt.NDArray[np.intp]) -> npt.NDArray[np.generic]:
            idx = torch.from_numpy(ids).to(self.device)
            return self._layers[layer].index_select(axis, idx).cpu().view(width).numpy()

        return block_checksums(
            pick,
            len(self._layers),
            self.geometry.dtype,
            block_ids,
            chunk_blocks=chunk_blocks,
            layerwise=layerwise,
        )

    def close(self) -> None:
        self._layers = []


def open_cuda(desc: IpcDescriptor) -> torch.Tensor:
    """The worker's tensor behind a ``cuda`` IPC descriptor (needs a GPU)."""
    raw: dict[str, Any] = desc.raw or {}
    meta = desc.metadata
    handle = raw.get("handle")
    if desc.type != "cuda" or meta is None or not isinstance(handle, list | tuple):
        raise InvalidInput(
            f"KV handle of kind {desc.type!r}: this server opens 'cuda' (PyTorch shared"
            " storage) handles only; use engine-driven transfer instead"
            ' ("lmcache.mp.mp_transfer_mode": "engine_driven")'
        )
    if not torch.cuda.is_available():
        raise InvalidInput("a CUDA KV registration reached a server that sees no GPU")
    device = _device_of(meta.device_uuid)
    storage = torch.UntypedStorage._new_shared_cuda(device, *handle[1:])
    t = torch.empty((), device=f"cuda:{device}", dtype=_DTYPES[meta.dtype])
    t.set_(storage, meta.storage_offset, tuple(meta.shape), tuple(meta.stride))
    return t


def _device_of(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise InvalidInput(f"the worker's GPU {uuid} is not visible to this server")


class CudaPagedKV(TorchPagedKV):
    """``TorchPagedKV`` over CUDA IPC handles, copies ordered by the worker's events."""

    def __init__(self, descs: Sequence[IpcDescriptor], chunk_size: int, kv_layout: str) -> None:
        layers = [open_cuda(d) for d in descs]
        super().__init__(layers, chunk_size, kv_layout)
        self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def begin(self, event_handle: bytes) -> None:
        """Order the copies after the worker's exported event (if any)."""
        if event_handle:
            event = torch.cuda.Event.from_ipc_handle(  # type: ignore[no-untyped-call]
                self.device, event_handle
            )
            self._stream.wait_event(event)
        torch.cuda.set_stream(self._stream)

    def end(self) -> bytes:
        """Wait for the copies; an empty handle: nothing left pending on the device."""
        self._stream.synchronize()
        return b""
