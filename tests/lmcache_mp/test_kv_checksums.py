"""kvatlas' ``/cache/checksums`` digests against LMCache 0.5.6's own code
(``checksum_ref.py`` in .venv-lmcache runs ``cache_api._compute_block_checksums`` and
``compress_slot_mapping``) over the same KV bytes in POSIX SHM: both KV layouts,
float16, bfloat16 (which LMCache widens to float32) and float32, flat and per layer,
ids out of order with a short last chunk."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from kvatlas.core.errors import InvalidInput
from kvatlas.server.lmcache_mp.cpu_kv import ITEMSIZES, CpuPagedKV
from kvatlas.server.lmcache_mp.kv_checksums import compress_ranges
from kvatlas.server.lmcache_mp.wire import IpcDescriptor, TensorMetadata
from lmcache_mp.conftest import shm_segments
from lmcache_mp.driver import QUIET

pytestmark = pytest.mark.lmcache

NB, BS, NH, HS, LAYERS, CHUNK = 12, 4, 2, 3, 3, 8
REF = Path(__file__).with_name("checksum_ref.py")
IDS = [9, 0, 3, 4, 5, 11, 2]
"""Out of order, a run of three (a range in ``block_id_ranges``), a short last chunk."""


@pytest.fixture
def segments() -> Iterator[list[shared_memory.SharedMemory]]:
    with shm_segments(LAYERS, 2 * NB * BS * NH * HS * 4) as shms:
        yield shms


def reference(lmcache_venv: Path, spec: dict[str, object]) -> dict[str, object]:
    env = {**os.environ, **QUIET}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(lmcache_venv / "bin" / "python"), str(REF), json.dumps(spec)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    answer: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return answer


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("kv_first", [True, False])
def test_digests_equal_lmcaches_own(
    segments: list[shared_memory.SharedMemory], lmcache_venv: Path, dtype: str, kv_first: bool
) -> None:
    shape = [2, NB, NH, BS, HS] if kv_first else [NB, 2, NH, BS, HS]
    strides = list(np.empty(shape, dtype=np.uint8).strides)
    meta = TensorMetadata(dtype, shape, strides, 0, "cpu")
    size = ITEMSIZES[dtype] * int(np.prod(shape))
    kv = CpuPagedKV(
        [IpcDescriptor("cpu_shm", 1, meta, "/" + s.name, size) for s in segments], CHUNK, "HND"
    )
    try:
        for layerwise in (False, True):
            ref = reference(
                lmcache_venv,
                {
                    "segments": [s.name for s in segments], "shape": shape, "dtype": dtype,
                    "block_axis": 1 if kv_first else 0, "seed": 5, "block_ids": IDS,
                    "chunk_size": 2, "layerwise": layerwise,
                },
            )  # fmt: skip
            assert kv.checksums(IDS, 2, layerwise) == ref["chunk_checksums"], (dtype, layerwise)
            assert compress_ranges(IDS) == ref["block_id_ranges"]
        with pytest.raises(InvalidInput, match=f"block id {NB} is outside"):
            kv.checksums([0, NB], 2, False)  # where LMCache's index_select would raise
    finally:
        kv.close()
