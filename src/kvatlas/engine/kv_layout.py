"""The fixed byte layout of one KV chunk, and the moves between it and a model's cache.

Owns the layout kvatlas stores, moves between nodes and loads into models. Every chunk of
``chunk_size`` tokens is one C-contiguous array::

    [layers][2: K then V][kv_heads][chunk_size tokens][head_dim]   elements of the KV dtype

so element ``(l, kv, h, t, d)`` lives at byte offset
``((((l * 2 + kv) * kv_heads + h) * chunk_size + t) * head_dim + d) * itemsize``, in the
machine's byte order (little-endian on every machine kvatlas runs on). A chunk is exactly
``chunk_nbytes(spec, chunk_size)`` bytes: ``layers * 2 * kv_heads * head_dim * itemsize``
per token (45 KiB for SmolLM2-135M in float32). Keys are stored after RoPE, exactly as
transformers keeps them in its cache, so they are only valid at the positions they were
computed at (prefix reuse). The layout together with the hash contract's (layers, kv heads,
head dim, dtype) is what two engines must share to use each other's bytes.

``extract_chunks`` packs tokens of a transformers ``DynamicCache`` into that layout;
``build_cache`` builds a ``DynamicCache`` from such buffers: by default one copy per layer
that never aliases them, or (``over_buffers=True``) layers that view the buffers where
they lie, e.g. leased chunks in the cache server's L1 mapping, and copy them exactly once,
at their first ``update`` (the prefill of the rest of the prompt concatenates there
anyway); ``settle_cache`` copies any layer not updated yet, after which nothing aliases
the buffers. Must not: hash, talk to a server, or run the model; it only moves bytes.

Exceptions::

    InvalidInput (kvatlas.core.errors)
     +-- KVLayoutError   a buffer that is not a chunk of this layout (size, contiguity)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from kvatlas.core.errors import InvalidInput

DEFAULT_CHUNK_SIZE: Final = 256

_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# A chunk buffer: anything exposing the buffer protocol (bytes, bytearray, memoryview, a
# C-contiguous numpy array such as a slot of the cache server's L1 region).
ChunkBuffer = bytes | bytearray | memoryview | npt.NDArray[np.generic]


class KVLayoutError(InvalidInput):
    """A buffer that is not one chunk of the expected layout."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a KV dtype name (``float32``, ``float16``, ``bfloat16``)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidInput(f"unsupported KV dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The KV dtype name of a torch dtype (inverse of ``torch_dtype``)."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise InvalidInput(f"unsupported KV dtype {dtype}; use one of {sorted(_DTYPES)}")


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The shape of a model's KV cache: what the chunk layout is made of."""

    layers: int
    """Decoder layers, each with its own K and V."""
    kv_heads: int
    """Key/value heads per layer (fewer than attention heads with GQA)."""
    head_dim: int
    """Elements per head and token."""
    dtype: str
    """Element type name: ``float32``, ``float16`` or ``bfloat16``."""

    @property
    def itemsize(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, K and V."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.itemsize

    def chunk_shape(self, chunk_size: int) -> tuple[int, int, int, int, int]:
        """(layers, 2, kv_heads, chunk_size, head_dim): the shape of one chunk."""
        return (self.layers, 2, self.kv_heads, chunk_size, self.head_dim)


def chunk_nbytes(spec: KVSpec, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """Bytes of one chunk of ``chunk_size`` tokens."""
    if chunk_size <= 0:
        raise InvalidInput(f"chunk size must be positive, got {chunk_size}")
    return spec.bytes_per_token * chunk_size


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer, (1, kv_heads, tokens, head_dim) each."""
    keys = getattr(cache.layers[layer], "keys", None)
    values = getattr(cache.layers[layer], "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise KVLayoutError(f"layer {layer} of the cache holds no key/value tensors")
    return keys, values


def spec_of_cache(cache: DynamicCache) -> KVSpec:
    """The KVSpec of a filled cache (batch size 1)."""
    if not cache.layers or cache.get_seq_length() == 0:
        raise KVLayoutError("the cache holds no KV")
    keys, _ = layer_kv(cache, 0)
    batch, kv_heads, _, head_dim = keys.shape
    if batch != 1:
        raise KVLayoutError(f"only batch size 1 is supported, the cache has {batch}")
    return KVSpec(len(cache.layers), kv_heads, head_dim, dtype_name(keys.dtype))


def extract_chunks(
    cache: DynamicCache,
    start_token: int,
    n_chunks: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> list[npt.NDArray[np.uint8]]:
    """Pack the KV of tokens ``[start_token, start_token + n_chunks * chunk_size)``.

    Returns one flat uint8 array per chunk, each exactly ``chunk_nbytes`` bytes in the
    module's layout, owned by numpy (a copy: the cache may change afterwards).
    """
    if n_chunks < 0 or start_token < 0:
        raise InvalidInput("start_token and n_chunks must not be negative")
    if n_chunks == 0:
        return []
    spec = spec_of_cache(cache)
    end = start_token + n_chunks * chunk_size
    have = cache.get_seq_length()
    if end > have:
        raise KVLayoutError(f"tokens up to {end} requested, the cache holds {have}")
    dtype = torch_dtype(spec.dtype)
    nbytes = chunk_nbytes(spec, chunk_size)
    out: list[npt.NDArray[np.uint8]] = []
    for c in range(n_chunks):
        lo = start_token + c * chunk_size
        raw = np.empty(nbytes, dtype=np.uint8)
        dst = torch.from_numpy(raw).view(dtype).view(spec.chunk_shape(chunk_size))
        for i in range(spec.layers):
            keys, values = layer_kv(cache, i)
            dst[i, 0].copy_(keys[0, :, lo : lo + chunk_size])
            dst[i, 1].copy_(values[0, :, lo : lo + chunk_size])
        out.append(raw)
    return out


def _chunk_view(buf: ChunkBuffer, spec: KVSpec, chunk_size: int, index: int) -> torch.Tensor:
    """A zero-copy tensor view of one chunk buffer, shaped ``spec.chunk_shape``."""
    expected = chunk_nbytes(spec, chunk_size)
    try:
        mv = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
        if not mv.c_contiguous:
            raise KVLayoutError(f"chunk {index} is not C-contiguous")
        flat = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
    except TypeError as exc:
        raise KVLayoutError(f"chunk {index} does not expose a byte buffer: {exc}") from exc
    if flat.nbytes != expected:
        raise KVLayoutError(
            f"chunk {index} has {flat.nbytes} bytes, a chunk of {chunk_size} tokens of"
            f" {spec} has {expected}"
        )
    # torch warns about read-only buffers (bytes, a read-only region mapping) because a
    # write through the tensor would be undefined; the views are only ever read, by the
    # torch.cat of build_cache or of a BufferLayer, so the warning does not apply here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(flat, dtype=torch_dtype(spec.dtype))
    return tensor.view(spec.chunk_shape(chunk_size))


def build_cache(
    chunks: Sequence[ChunkBuffer],
    spec: KVSpec,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    n_tokens: int | None = None,
    config: PretrainedConfig | None = None,
    over_buffers: bool = False,
) -> DynamicCache:
    """A DynamicCache holding the first ``n_tokens`` tokens of ``chunks`` (default: all).

    The buffers are viewed without a copy. By default each layer is concatenated once
    along the sequence and the cache never aliases the buffers, so they may be reused
    when this returns. With ``over_buffers`` the layers keep the views and copy at their
    first ``update`` (the next prefill's concatenation): the buffers must stay valid and
    unchanged until then or until ``settle_cache``. ``config`` (the model's) lets
    transformers pick its layer types; a layer of another type than ``DynamicLayer``
    is always copied here. Raises KVLayoutError for a buffer of the wrong size or shape
    before anything is built.
    """
    total = len(chunks) * chunk_size
    n = total if n_tokens is None else n_tokens
    if not 0 < n <= total:
        raise KVLayoutError(f"n_tokens must be in [1, {total}], got {n}")
    views = [_chunk_view(buf, spec, chunk_size, i) for i, buf in enumerate(chunks)]
    views = views[: -(-n // chunk_size)]
    tail = n - (len(views) - 1) * chunk_size
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for layer in range(spec.layers):
        kv: list[list[torch.Tensor]] = []
        for which in (0, 1):
            parts = [v[layer, which].unsqueeze(0) for v in views]
            parts[-1] = parts[-1][:, :, :tail]
            kv.append(parts)
        _fill_layer(cache, layer, kv[0], kv[1], over_buffers)
    if cache.get_seq_length() != n:
        raise KVLayoutError(f"built a cache of {cache.get_seq_length()} tokens, expected {n}")
    return cache


def settle_cache(cache: DynamicCache) -> None:
    """Copy every layer that still views its buffers (``build_cache(over_buffers=True)``
    not updated since): afterwards the cache aliases no buffer."""
    for layer in cache.layers:
        if isinstance(layer, BufferLayer):
            layer.settle()


class BufferLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers is untyped
    """A ``DynamicLayer`` whose prefix is a list of views over chunk buffers until its
    first ``update`` (or ``settle``) concatenates them, with the new states, into the one
    tensor transformers expects: the prefix is copied once, where a plain layer built by
    copying would be copied twice (once to build, once more by the update's concat)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._parts: tuple[list[torch.Tensor], list[torch.Tensor]] | None = (keys, values)
        self._pending = sum(int(k.shape[-2]) for k in keys)
        self.device = keys[0].device
        # Placeholders until the first update: 0-token tensors of the right kind.
        self.keys = keys[0][:, :, :0]
        self.values = values[0][:, :, :0]
        self.is_initialized = True

    @property
    def viewing(self) -> bool:
        """True while the prefix is still the views over the buffers."""
        return self._parts is not None

    def settle(self) -> None:
        """Concatenate the viewed prefix into tensors of this layer's own."""
        if self._parts is not None:
            keys, values = self._parts
            self.keys, self.values = torch.cat(keys, dim=-2), torch.cat(values, dim=-2)
            self._parts = None
            self._pending = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._parts is None:
            return super().update(key_states, value_states, *args, **kwargs)
        keys, values = self._parts
        # The new states arrive transposed (non-contiguous); torch.cat then takes a slow
        # strided path for the whole output, so they are made contiguous first (a copy of
        # the suffix only).
        self.keys = torch.cat([*keys, key_states.contiguous()], dim=-2)
        self.values = torch.cat([*values, value_states.contiguous()], dim=-2)
        self._parts = None
        self._pending = 0
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if self._parts is not None:
            return self._pending
        return super().get_seq_length()

    def reset(self) -> None:
        self._parts = None
        self._pending = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.settle()
        super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.settle()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.settle()
        super().batch_select_indices(indices)


def _fill_layer(
    cache: DynamicCache,
    layer: int,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    over_buffers: bool,
) -> None:
    """Put the parts of ``keys``/``values`` into an empty cache layer.

    ``DynamicLayer.update`` concatenates onto an empty tensor, which copies the whole
    prefix a second time (~3x the cost of building it here). An update with zero tokens
    lets transformers initialise the layer; a plain DynamicLayer then takes one
    concatenated tensor as it is, or is replaced by a ``BufferLayer`` over the parts;
    any other layer type gets the ordinary, copying update.
    """
    cache.update(keys[0][:, :, :0], values[0][:, :, :0], layer)
    target = cache.layers[layer]
    if type(target) is DynamicLayer and target.get_seq_length() == 0:
        if over_buffers:
            cache.layers[layer] = BufferLayer(keys, values)
        else:
            target.keys, target.values = torch.cat(keys, dim=-2), torch.cat(values, dim=-2)
        return
    cache.update(torch.cat(keys, dim=-2), torch.cat(values, dim=-2), layer)
