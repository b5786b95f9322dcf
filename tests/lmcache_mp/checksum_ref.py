"""LMCache 0.5.6's own ``/cache/checksums`` computation over KV layers in POSIX SHM, run
by .venv-lmcache's Python: the reference kvatlas' digests are compared with.

argv: one JSON object, ``{"segments": [shm names], "shape": [...], "dtype": "bfloat16",
"block_axis": 1, "seed": 3, "block_ids": [...], "chunk_size": 2, "layerwise": false}``.
Fills each segment with seeded random KV of that shape and dtype (torch's own layout),
then prints one JSON line: LMCache's answer (``cache_api._compute_block_checksums``)
and its ``compress_slot_mapping`` of the ids, as the route answers them.

Not part of the kvatlas package: it imports lmcache, which only .venv-lmcache has.
"""

from __future__ import annotations

import json
import sys
from multiprocessing import resource_tracker, shared_memory

import torch
from lmcache.utils import compress_slot_mapping
from lmcache.v1.multiprocess.http_apis.cache_api import _compute_block_checksums


def main() -> None:
    spec = json.loads(sys.argv[1])
    dtype = getattr(torch, spec["dtype"])
    shape = tuple(spec["shape"])
    gen = torch.Generator().manual_seed(spec["seed"])
    shms = [shared_memory.SharedMemory(name=n) for n in spec["segments"]]
    for shm in shms:  # the test owns them: this process's exit must not unlink them
        resource_tracker.unregister(f"/{shm.name}", "shared_memory")
    layers = []
    for shm in shms:
        t = torch.frombuffer(shm.buf, dtype=dtype, count=torch.Size(shape).numel()).view(shape)
        t.copy_(torch.randn(shape, generator=gen).to(dtype))
        layers.append(t)
    axes = [spec["block_axis"]] * len(layers)
    answer = _compute_block_checksums(
        layers, spec["block_ids"], axes, spec["chunk_size"], spec["layerwise"]
    )
    answer["block_id_ranges"] = compress_slot_mapping(spec["block_ids"])
    print(json.dumps(answer), flush=True)
    del layers, t
    for shm in shms:
        shm.close()


if __name__ == "__main__":
    main()
