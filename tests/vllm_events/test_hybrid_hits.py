"""Issue #38 item 2: a hybrid model's prefix counts only as far as vLLM would hit it.

vLLM's own `KVCacheManager` (a full-attention group and a sliding-window group of a
two-block window, a pool small enough to evict) runs a seeded workload of prompts that
share prefixes; every batch of events it takes (`take_events`, as the engine core
publishes them, with each store's ``kv_cache_spec_kind`` and window) is encoded as
vLLM's `EventBatch` (as its publisher packs it), decoded by kvatlas and applied to a
`DeviceIndex`. After each step, for probe prompts, the index's leading run must equal vLLM's
`get_computed_blocks` hit (over the blocks vLLM may hit: all but the prompt's last
token). The old rule (a block held by any group counts) must disagree somewhere, or
the workload would not test the rule."""

from __future__ import annotations

import random
import warnings
from typing import Any

import msgspec
import pytest

from kvatlas.core.coordinator.block_table import prompt_keys
from kvatlas.core.device_blocks import DeviceIndex, EngineId, fold_groups
from kvatlas.wire.vllm_events import decode_message, message

pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM not installed (scripts/bootstrap.sh)"
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from vllm.distributed.kv_events import EventBatch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request

B = 16
E = EngineId("e")


def _manager() -> KVCacheManager:
    fa = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float32)
    sw = SlidingWindowSpec(
        block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=2 * B
    )
    config = KVCacheConfig(
        num_blocks=48,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["fa"], fa), KVCacheGroupSpec(["sw"], sw)],
    )
    return KVCacheManager(
        config,
        max_model_len=4096,
        scheduler_block_size=B,
        hash_block_size=B,
        enable_kv_cache_events=True,
    )


def _any_group(ix: DeviceIndex, keys: bytes) -> int:
    """The old rule: the leading run of blocks held by any group."""
    n = 0
    for m in ix.masks(E, keys):
        if not fold_groups(m):
            break
        n += 1
    return n


def test_index_hits_what_vllms_hybrid_coordinator_hits() -> None:
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(B, sha256_cbor)
    manager = _manager()
    ix = DeviceIndex()
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(38)
    seq = 0
    ids = 0

    def request(tokens: list[int]) -> Any:
        nonlocal ids
        ids += 1
        return Request(
            request_id=str(ids),
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
        )

    def publish() -> None:
        nonlocal seq
        events = manager.take_events()
        if events:
            payload = enc.encode(EventBatch(ts=1.0, events=events))
            batch = decode_message(list(message(b"", seq, payload)))
            assert batch.malformed_events == batch.unknown_types == 0
            ix.apply(E, batch.events)
            seq += 1

    stems = [[rng.randrange(50_000) for _ in range(6 * B)] for _ in range(4)]

    def prompt() -> list[int]:
        stem = rng.choice(stems)[: rng.randrange(1, 6 * B)]
        return stem + [rng.randrange(50_000) for _ in range(rng.randrange(1, 3 * B))]

    disagreed = 0
    checked = 0
    for _ in range(60):
        r = request(prompt())
        blocks, hit, _ = manager.get_computed_blocks(r)
        n = len(r.prompt_token_ids)
        if manager.allocate_slots(r, n - hit, hit, blocks) is None:
            continue
        r.num_computed_tokens = n
        publish()
        manager.free(r)
        publish()
        for _ in range(4):
            probe = request(prompt())
            want = manager.get_computed_blocks(probe)[1]
            usable = (len(probe.prompt_token_ids) - 1) // B
            keys = prompt_keys(probe.prompt_token_ids[: usable * B], B)
            got, _ = ix.leading(E, keys)
            assert got * B == want, (got, want)
            checked += 1
            disagreed += _any_group(ix, keys) != got
    assert checked > 100
    assert disagreed, "the workload never told the old rule from vLLM's"
