"""One layer's keys or values out of a transformers cache, for the tests to compare.

transformers types ``Cache.layers`` as a union that includes linear-attention and dummy
layers, and a layer's tensors as optional. The engine's caches hold attention layers with
both tensors set: these helpers check that, so a test compares tensors, never ``None``.
"""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin


def layer_of(cache: Cache, layer: int) -> CacheLayerMixin:
    entry = cache.layers[layer]
    assert isinstance(entry, CacheLayerMixin), f"layer {layer} is a {type(entry).__name__}"
    return entry


def keys_of(cache: Cache, layer: int) -> torch.Tensor:
    keys = layer_of(cache, layer).keys
    assert keys is not None, f"layer {layer} holds no keys"
    return keys


def values_of(cache: Cache, layer: int) -> torch.Tensor:
    values = layer_of(cache, layer).values
    assert values is not None, f"layer {layer} holds no values"
    return values
