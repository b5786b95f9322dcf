"""The model's KV storage: an arena kept across requests, layers writing in place."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from engine.layers import keys_of, values_of
from kvatlas.engine.generate import prefill
from kvatlas.engine.kv_cache import ArenaLayer, KVArena, KVArenaReused, settle_cache
from kvatlas.engine.kv_layout import (
    KVLayoutError,
    KVSpec,
    build_cache,
    extract_chunks,
    layer_parts,
)
from kvatlas.engine.model import LoadedModel

SPEC = KVSpec(layers=2, kv_heads=2, head_dim=4, dtype="float32")


def states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (1, SPEC.kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def random_ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(256) for _ in range(n)]


@torch.inference_mode()
def test_decode_in_the_arena_equals_transformers_cache_bit_for_bit(tiny: LoadedModel) -> None:
    """Prefill and decode over arena layers (in place, strided views) give the logits of
    transformers' own concatenating layers, and the states stay where the arena put them."""
    ids = random_ids(300, seed=3)
    arena = KVArena(tiny.kv_spec)
    caches = [DynamicCache(config=tiny.model.config), arena.cache(tiny.model.config)]
    outs = [tiny.model(input_ids=torch.tensor([ids]), cache=c, use_cache=True) for c in caches]
    assert torch.equal(outs[0].logits, outs[1].logits)
    storage = arena.storage(0, 0, 0)[0]
    for step in range(6):
        tok = int(outs[0].logits[0, -1].argmax())
        outs = [
            tiny.model(input_ids=torch.tensor([[tok]]), cache=c, use_cache=True, logits_to_keep=1)
            for c in caches
        ]
        assert torch.equal(outs[0].logits, outs[1].logits), step
    layer = caches[1].layers[0]
    assert isinstance(layer, ArenaLayer) and layer.get_seq_length() == 306
    assert keys_of(caches[1], 0).data_ptr() == storage.data_ptr()  # written in place, never moved
    assert torch.equal(keys_of(caches[1], 0), keys_of(caches[0], 0))
    assert arena.grown == tiny.kv_spec.layers  # one allocation per layer for all of it


def test_the_arena_is_reused_and_an_earlier_cache_refused(tiny: LoadedModel) -> None:
    arena = KVArena(tiny.kv_spec)
    first = prefill(tiny, random_ids(700, seed=1), arena=arena)
    grown, held = arena.grown, arena.nbytes
    second = prefill(tiny, random_ids(600, seed=2), arena=arena)
    assert (arena.grown, arena.nbytes) == (grown, held)  # no new storage
    assert keys_of(second.cache, 0).data_ptr() == keys_of(first.cache, 0).data_ptr()
    with pytest.raises(KVArenaReused, match="layer 0"), torch.inference_mode():
        tiny.model(input_ids=torch.tensor([[5]]), cache=first.cache, use_cache=True)
    # the current owner is untouched by that refusal
    assert second.cache.get_seq_length() == 600


def test_storage_grows_keeping_the_tokens() -> None:
    arena = KVArena(SPEC)
    cache = arena.cache()
    written = [states(1000, 0), states(500, 1), states(700, 2)]
    for k, v in written:
        cache.update(k, v, 0)
    keys, values = keys_of(cache, 0), values_of(cache, 0)
    assert torch.equal(keys, torch.cat([k for k, _ in written], dim=-2))
    assert torch.equal(values, torch.cat([v for _, v in written], dim=-2))
    # 1000 + headroom -> 2048 tokens, then 2200 > 2048 -> at least 1.5x: 3072
    assert arena.storage(0, 0, 0)[0].shape[2] == 3072 and arena.grown == 2
    assert arena.capacity == 0  # layer 1 never held anything
    with pytest.raises(KVLayoutError, match="expected"):
        cache.update(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), 0)


def test_crop_reset_and_batch_operations() -> None:
    k, v = states(40, 0)
    arrays = extract_chunks(_filled(k, v), 0, 2, 16)
    cache = KVArena(SPEC).cache(None, layer_parts(arrays, SPEC, 16, 32))
    layer = cache.layers[0]
    assert isinstance(layer, ArenaLayer) and layer.viewing
    layer.crop(-4)  # copies the prefix in, then forgets 4 tokens
    assert not layer.viewing and layer.get_seq_length() == 28
    nk, nv = states(3, 9)
    keys, _ = cache.update(nk, nv, 0)
    assert torch.equal(keys, torch.cat([k[:, :, :28], nk], dim=-2))
    with pytest.raises(ValueError, match="positive"):
        layer.crop(3)
    layer.reset()
    assert layer.get_seq_length() == 0
    keys, _ = cache.update(nk, nv, 0)
    assert torch.equal(keys, nk)
    other = cache.layers[1]
    assert isinstance(other, ArenaLayer) and other.viewing
    other.batch_repeat_interleave(2)  # leaves the arena with its prefix, as tensors of its own
    assert not other.in_arena and other.keys.shape[0] == 2
    assert torch.equal(other.keys[1], k[0, :, :32])
    keys, _ = cache.update(torch.cat([nk, nk]), torch.cat([nv, nv]), 1)
    assert keys.shape == (2, 2, 35, 4)
    for a in arrays:
        a[:] = 0
    assert torch.equal(other.keys[0, :, :32], k[0, :, :32])


def _filled(k: torch.Tensor, v: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    for layer in range(SPEC.layers):
        cache.update(k, v, layer)
    return cache


def test_chunks_lying_at_equal_distances_are_one_part() -> None:
    """Leased slots one after another in the L1 array become one view (one copy per
    layer); anything else stays one part per chunk; the result is the same either way."""
    k, v = states(80, 4)
    source = _filled(k, v)
    arrays = extract_chunks(source, 0, 5, 16)
    nb = arrays[0].nbytes
    region = np.zeros(6 * nb + 64, np.uint8)  # stands for the server's L1 region
    starts = [0, nb, 2 * nb, 3 * nb + 64, 4 * nb + 64]  # a gap after the third chunk
    slots = [region[s : s + nb] for s in starts]
    for slot, a in zip(slots, arrays, strict=True):
        slot[:] = a
    keys, _ = layer_parts(slots, SPEC, 16)[1]
    assert [tuple(p.shape) for p in keys] == [(1, 2, 3, 16, 4), (1, 2, 2, 16, 4)]
    assert keys[1].data_ptr() == slots[3][nb // 2 :].ctypes.data  # layer 1's K, in place
    keys, _ = layer_parts(slots, SPEC, 16, 79)[1]  # the partial last chunk stands alone
    assert [p.dim() for p in keys] == [5, 4, 4]
    spaced = [region[s : s + nb] for s in (0, 2 * nb, 4 * nb)]  # every other slot
    for slot, a in zip(spaced, arrays[:3], strict=True):
        slot[:] = a
    assert len(layer_parts(spaced, SPEC, 16)[0][0]) == 1
    assert [len(layer_parts([bytes(a) for a in arrays], SPEC, 16)[0][0])] == [5]
    for slot, a in zip(slots, arrays, strict=True):
        slot[:] = a
    for n in (80, 79):
        cache = KVArena(SPEC).cache(None, layer_parts(slots, SPEC, 16, n))
        settle_cache(cache)
        copied = build_cache(slots, SPEC, 16, n_tokens=n)
        for layer in range(SPEC.layers):
            assert torch.equal(keys_of(cache, layer), k[:, :, :n])
            assert torch.equal(values_of(cache, layer), v[:, :, :n])
            assert torch.equal(keys_of(copied, layer), k[:, :, :n])
