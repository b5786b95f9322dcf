"""The model's KV cache storage: an arena kept across requests, and cache layers over it.

Owns where the reference engine's model keeps its keys and values. ``KVArena`` holds,
per decoder layer, one K and one V tensor of shape ``(1, kv_heads, capacity, head_dim)``;
an ``ArenaLayer`` is a transformers ``DynamicLayer`` whose keys and values are the first
``n`` tokens of that storage (views). Why not transformers' own ``DynamicLayer``:

- it concatenates the whole cache with the new states at every forward, so a prefix
  loaded from chunks is copied again by the suffix prefill and by every decode step; an
  ``ArenaLayer`` writes the new states in place;
- each concatenation allocates fresh memory, and fresh pages cost a minor fault per 4 KiB
  on first write (tens of thousands for a 4k-token SmolLM2 prefix, which made its
  copy several times slower, and varied with what the allocator had kept). The arena's
  storage is allocated once, grows to the longest request seen and is reused, so its
  pages stay mapped.

A layer may start with a *prefix*: per-layer parts viewing buffers the cache does not own
(``kv_layout.layer_parts`` over leased L1 chunks). They are read where they lie and
copied into the storage once (one copy per part), at the layer's first ``update``, just
before its attention reads them (so the attention finds them in the CPU cache), or by
``settle`` / ``settle_cache`` for a layer the forward did not update. After that nothing aliases the
buffers, and their leases may end.

One arena serves one cache at a time: ``KVArena.cache`` hands the storage to a new cache,
and a layer of an earlier cache then refuses to update (``KVArenaReused``), because the new
owner overwrites its tensors. The engine runs one request at a time on one worker thread,
which is what makes one arena per engine enough. Batch size 1; a batch operation
(``batch_repeat_interleave``, ``batch_select_indices``) moves that layer out of the arena
into tensors of its own.

Must not: know the chunk layout (``kv_layout`` does), talk to a cache server, or run the
model.

Exceptions::

    InvalidInput (kvatlas.core.errors)
     +-- KVLayoutError (kv_layout)   states of another shape or dtype than the arena's
    KvatlasError
     +-- KVArenaReused               a layer used after its arena went to a later cache
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from kvatlas.core.errors import KvatlasError
from kvatlas.engine.kv_layout import (
    KVLayoutError,
    KVSpec,
    LayerParts,
    concat_parts,
    copy_parts,
    part_tokens,
    torch_dtype,
)

_GRANULE: Final = 1024
"""Tokens: the storage grows in steps of this."""
_HEADROOM: Final = 256
"""Tokens of decode room added whenever the storage grows, so that the first tokens a
request decodes after a long prompt do not grow (copy) the whole cache again."""


class KVArenaReused(KvatlasError):
    """A cache layer used after its arena was handed to a later cache."""


class KVArena:
    """Per-layer K and V storage for one cache at a time, reused across requests."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self._dtype = torch_dtype(spec.dtype)
        self._keys: list[torch.Tensor | None] = [None] * spec.layers
        self._values: list[torch.Tensor | None] = [None] * spec.layers
        self.epoch = 0
        """Bumped by every ``cache``: a layer compares it with the epoch it was made in."""
        self.grown = 0
        """How many times a layer's storage was (re)allocated."""

    @property
    def capacity(self) -> int:
        """Tokens every layer can hold without growing (0 before the first use)."""
        return min((0 if k is None else int(k.shape[2]) for k in self._keys), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of storage held, K and V of every layer."""
        held = [t for t in (*self._keys, *self._values) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def storage(self, layer: int, tokens: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V storage, holding at least ``tokens`` tokens.

        Growing allocates anew (rounded up, with decode headroom, at least 1.5x the old
        capacity) and copies the first ``keep`` tokens over.
        """
        keys, values = self._keys[layer], self._values[layer]
        if keys is None or values is None or keys.shape[2] < tokens:
            old = 0 if keys is None else int(keys.shape[2])
            want = max(tokens + _HEADROOM, old + old // 2)
            cap = -(-want // _GRANULE) * _GRANULE
            shape = (1, self.spec.kv_heads, cap, self.spec.head_dim)
            new_k = torch.empty(shape, dtype=self._dtype)
            new_v = torch.empty(shape, dtype=self._dtype)
            if keys is not None and values is not None and keep:
                new_k[:, :, :keep].copy_(keys[:, :, :keep])
                new_v[:, :, :keep].copy_(values[:, :, :keep])
            self._keys[layer], self._values[layer] = keys, values = new_k, new_v
            self.grown += 1
        return keys, values

    def cache(
        self,
        config: PretrainedConfig | None = None,
        prefix: Sequence[LayerParts] | None = None,
    ) -> DynamicCache:
        """A new cache over this arena (earlier caches of it may no longer update).

        ``config`` (the model's) lets transformers pick its layer types; every plain
        ``DynamicLayer`` becomes an ``ArenaLayer``, any other type (a sliding window) is
        kept and gets a copy of its prefix here. ``prefix`` (one entry per layer) views
        buffers that must stay valid and unchanged until each layer's first update or
        ``settle_cache``.
        """
        if prefix is not None and len(prefix) != self.spec.layers:
            raise KVLayoutError(f"a prefix of {len(prefix)} layers for {self.spec.layers}")
        self.epoch += 1
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
        while len(cache.layers) < self.spec.layers:
            cache.layers.append(DynamicLayer())  # type: ignore[no-untyped-call]  # untyped
        for i, layer in enumerate(cache.layers):
            keys, values = prefix[i] if prefix is not None else ([], [])
            if type(layer) is DynamicLayer:
                cache.layers[i] = ArenaLayer(self, i, keys, values)
            elif keys:
                cache.update(concat_parts(keys), concat_parts(values), i)
        return cache


class ArenaLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers is untyped
    """A ``DynamicLayer`` over one layer of a ``KVArena`` (see the module doc)."""

    def __init__(
        self,
        arena: KVArena,
        index: int,
        keys: list[torch.Tensor] | None = None,
        values: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers is untyped
        self._arena: KVArena | None = arena
        self._index = index
        self._epoch = arena.epoch
        self._parts = (keys, values) if keys and values else None
        self._pending = sum(part_tokens(k) for k in keys) if keys else 0
        self._n = 0
        spec = arena.spec
        self.device = torch.device("cpu")
        # Placeholders until the first update: 0-token tensors of the right kind.
        empty = torch.empty((1, spec.kv_heads, 0, spec.head_dim), dtype=torch_dtype(spec.dtype))
        self.keys, self.values = empty, empty
        self.is_initialized = True

    @property
    def viewing(self) -> bool:
        """True while the prefix is still the views over the buffers."""
        return self._parts is not None

    @property
    def in_arena(self) -> bool:
        """False once a batch operation moved the layer into tensors of its own."""
        return self._arena is not None

    def _own(self) -> KVArena:
        arena = self._arena
        assert arena is not None
        if arena.epoch != self._epoch:
            raise KVArenaReused(
                f"layer {self._index} belongs to a cache whose arena went to a later one"
            )
        return arena

    def _take_parts(self, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Storage for the prefix plus ``extra`` tokens, with the prefix copied in."""
        keys_store, values_store = self._own().storage(self._index, self._pending + extra, 0)
        if self._parts is not None:
            keys, values = self._parts
            n = self._pending
            # straight into the storage, one copy per part (a run of chunks is one part):
            # no temporary, no second copy
            copy_parts(keys, keys_store[:, :, :n])
            copy_parts(values, values_store[:, :, :n])
            self._parts, self._pending, self._n = None, 0, n
        return keys_store, values_store

    def settle(self) -> None:
        """Copy a prefix still viewed into the arena: afterwards nothing aliases it."""
        if self._parts is not None and self._arena is not None:
            keys_store, values_store = self._take_parts(0)
            self.keys, self.values = keys_store[:, :, : self._n], values_store[:, :, : self._n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._arena is None:
            return super().update(key_states, value_states, *args, **kwargs)
        spec = self._arena.spec
        expected = (1, spec.kv_heads, spec.head_dim, torch_dtype(spec.dtype))
        got = (key_states.shape[0], key_states.shape[1], key_states.shape[3], key_states.dtype)
        if got != expected:
            raise KVLayoutError(f"states of (batch, kv heads, head dim, dtype) {got}, expected"
                                f" {expected}")  # fmt: skip
        new = int(key_states.shape[-2])
        if self._parts is not None:
            keys_store, values_store = self._take_parts(new)
        else:
            arena = self._own()
            keys_store, values_store = arena.storage(self._index, self._n + new, self._n)
        end = self._n + new
        keys_store[:, :, self._n : end].copy_(key_states)
        values_store[:, :, self._n : end].copy_(value_states)
        self._n = end
        self.keys, self.values = keys_store[:, :, :end], values_store[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if self._arena is None:
            return int(super().get_seq_length())
        return self._pending if self._parts is not None else self._n

    def reset(self) -> None:
        self._parts, self._pending, self._n = None, 0, 0
        super().reset()
        if self._arena is not None:
            # DynamicLayer.reset drops the tensors; this layer keeps its placeholders
            spec = self._arena.spec
            shape = (1, spec.kv_heads, 0, spec.head_dim)
            self.keys = self.values = torch.empty(shape, dtype=torch_dtype(spec.dtype))
            self.is_initialized = True

    def crop(self, tokens_to_remove: int) -> None:
        if self._arena is None or tokens_to_remove >= 0:
            # DynamicLayer's contract: a positive count is refused, 0 changes nothing
            super().crop(tokens_to_remove)
            return
        self.settle()
        self._n = max(0, self._n + tokens_to_remove)
        keys_store, values_store = self._own().storage(self._index, self._n, self._n)
        self.keys, self.values = keys_store[:, :, : self._n], values_store[:, :, : self._n]

    def _leave_arena(self) -> None:
        self.settle()
        if self._arena is not None:
            keys_store, values_store = self._own().storage(self._index, self._n, self._n)
            self.keys = keys_store[:, :, : self._n].clone()
            self.values = values_store[:, :, : self._n].clone()
            self._arena = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._leave_arena()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._leave_arena()
        super().batch_select_indices(indices)


def settle_cache(cache: DynamicCache) -> None:
    """Copy every layer that still views its buffers (not updated since ``cache``):
    afterwards the cache aliases no buffer."""
    for layer in cache.layers:
        if isinstance(layer, ArenaLayer):
            layer.settle()
