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
``layer_parts`` views such buffers (bytes, leased chunks in the cache server's L1 mapping)
as per-layer key/value tensors without a copy, for ``kv_cache.KVArena`` to copy into the
model's cache; ``build_cache`` builds a ``DynamicCache`` of its own from them (one copy
per layer that never aliases the buffers). Must not: hash, talk to a server, keep the
model's cache storage (``kv_cache`` does), or run the model; it only moves bytes.

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

# One layer's keys and values as a list of (1, kv_heads, tokens, head_dim) parts each.
LayerParts = tuple[list[torch.Tensor], list[torch.Tensor]]


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
    # write through the tensor would be undefined; the views are only ever read (copied
    # by build_cache or into a KVArena), so the warning does not apply here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensor = torch.frombuffer(flat, dtype=torch_dtype(spec.dtype))
    return tensor.view(spec.chunk_shape(chunk_size))


def layer_parts(
    chunks: Sequence[ChunkBuffer],
    spec: KVSpec,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    n_tokens: int | None = None,
) -> list[LayerParts]:
    """Per layer, the keys and values of the first ``n_tokens`` tokens of ``chunks``
    (default: all) as views over the buffers, no copy, in token order.

    A part is one chunk, ``(1, kv_heads, tokens, head_dim)`` (the last one cut to the
    tail), or a *run* of ``k`` full chunks lying at equal distances in one numpy array
    (leased slots of the cache server's L1 region usually do: the server reserves a
    prefix's slots one after another), ``(1, kv_heads, k, chunk_size, head_dim)``: one
    view, and one copy per layer instead of ``k`` (``copy_parts``). Raises KVLayoutError
    for a buffer of the wrong size or shape before any view is made.
    """
    total = len(chunks) * chunk_size
    n = total if n_tokens is None else n_tokens
    if not 0 < n <= total:
        raise KVLayoutError(f"n_tokens must be in [1, {total}], got {n}")
    views = [_chunk_view(buf, spec, chunk_size, i) for i, buf in enumerate(chunks)]
    used = -(-n // chunk_size)
    tail = n - (used - 1) * chunk_size
    full = used if tail == chunk_size else used - 1
    blocks: list[torch.Tensor] = []  # (k, layers, 2, kv_heads, tokens, head_dim) each
    for first, count, run in _runs(chunks[:full], spec, chunk_size):
        blocks.append(run if run is not None else views[first].unsqueeze(0))
        if run is None:
            blocks.extend(v.unsqueeze(0) for v in views[first + 1 : first + count])
    if full < used:
        blocks.append(views[full][:, :, :, :tail].unsqueeze(0))
    out: list[LayerParts] = []
    for layer in range(spec.layers):
        keys, values = [], []
        for block in blocks:
            # (k, kv_heads, tokens, head_dim) -> (1, kv_heads, [k,] tokens, head_dim)
            k_part = block[:, layer, 0].permute(1, 0, 2, 3).unsqueeze(0)
            v_part = block[:, layer, 1].permute(1, 0, 2, 3).unsqueeze(0)
            keys.append(k_part if block.shape[0] > 1 else k_part.squeeze(2))
            values.append(v_part if block.shape[0] > 1 else v_part.squeeze(2))
        out.append((keys, values))
    return out


def part_tokens(part: torch.Tensor) -> int:
    """Tokens in one part of ``layer_parts`` (a chunk or a run of chunks)."""
    return int(part.shape[2] * part.shape[3]) if part.dim() == 5 else int(part.shape[2])


def copy_parts(parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy ``parts`` one after another along the tokens of ``out`` (1, kv_heads, tokens,
    head_dim; a view into larger storage is fine): one copy per part."""
    pos = 0
    for part in parts:
        n = part_tokens(part)
        dst = out[:, :, pos : pos + n]
        if part.dim() == 5:
            dst = dst.view(1, out.shape[1], part.shape[2], part.shape[3], out.shape[3])
        dst.copy_(part)
        pos += n


def concat_parts(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` in one new tensor of their own (1, kv_heads, tokens, head_dim)."""
    first = parts[0]
    shape = (1, first.shape[1], sum(part_tokens(p) for p in parts), first.shape[-1])
    out = torch.empty(shape, dtype=first.dtype)
    copy_parts(parts, out)
    return out


def _runs(
    chunks: Sequence[ChunkBuffer], spec: KVSpec, chunk_size: int
) -> list[tuple[int, int, torch.Tensor | None]]:
    """(first, count, view) for consecutive chunks: ``view`` covers ``count`` > 1 chunks
    lying at one distance from each other inside one numpy array, shaped
    (count, layers, 2, kv_heads, chunk_size, head_dim); None for a lone chunk."""
    nbytes = chunk_nbytes(spec, chunk_size)
    itemsize = spec.itemsize
    spots: list[tuple[int, int] | None] = []  # (id of the array, address) of each chunk
    for buf in chunks:
        root = buf.base if isinstance(buf, np.ndarray) else None
        if isinstance(buf, np.ndarray) and isinstance(root, np.ndarray):
            ok = root.flags.c_contiguous
            spots.append((id(root), buf.__array_interface__["data"][0]) if ok else None)
        else:
            spots.append(None)
    out: list[tuple[int, int, torch.Tensor | None]] = []
    i = 0
    while i < len(chunks):
        j = i + 1
        here = spots[i]
        if here is not None and i + 1 < len(chunks):
            nxt = spots[i + 1]
            step = nxt[1] - here[1] if nxt is not None and nxt[0] == here[0] else 0
            if step >= nbytes and step % itemsize == 0:
                while j < len(chunks) and spots[j] == (here[0], here[1] + (j - i) * step):
                    j += 1
        if j - i == 1:
            out.append((i, 1, None))
        else:
            out.append((i, j - i, _run_view(chunks[i], spec, chunk_size, j - i, step)))
        i = j
    return out


def _run_view(
    first: ChunkBuffer, spec: KVSpec, chunk_size: int, count: int, step: int
) -> torch.Tensor:
    """One tensor over ``count`` chunks ``step`` bytes apart, from ``first`` on, inside
    ``first``'s numpy array (checked by the caller: every chunk lies in it)."""
    assert isinstance(first, np.ndarray) and isinstance(first.base, np.ndarray)
    root = first.base
    start = first.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    itemsize = spec.itemsize
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        whole = torch.frombuffer(root.data.cast("B"), dtype=torch.uint8)
    span = whole[start : start + (count - 1) * step + chunk_nbytes(spec, chunk_size)]
    typed = span.view(torch_dtype(spec.dtype)) if start % itemsize == 0 else None
    if typed is None:
        raise KVLayoutError("chunk run not aligned to the KV dtype")
    inner = spec.chunk_shape(chunk_size)
    strides = [1]
    for dim in reversed(inner[1:]):
        strides.insert(0, strides[0] * dim)
    return typed.as_strided((count, *inner), (step // itemsize, *strides))


def build_cache(
    chunks: Sequence[ChunkBuffer],
    spec: KVSpec,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    n_tokens: int | None = None,
    config: PretrainedConfig | None = None,
) -> DynamicCache:
    """A DynamicCache holding a copy of the first ``n_tokens`` tokens of ``chunks``
    (default: all), which never aliases the buffers: they may be reused when this
    returns. ``config`` (the model's) lets transformers pick its layer types. Raises
    KVLayoutError for a buffer of the wrong size or shape before anything is built.
    (The engine's prefill does not copy here: ``kv_cache.KVArena`` views the chunks and
    copies each layer into storage it keeps across requests.)
    """
    parts = layer_parts(chunks, spec, chunk_size, n_tokens)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for layer, (keys, values) in enumerate(parts):
        _fill_layer(cache, layer, keys, values)
    n = sum(part_tokens(k) for k in parts[0][0])
    if cache.get_seq_length() != n:
        raise KVLayoutError(f"built a cache of {cache.get_seq_length()} tokens, expected {n}")
    return cache


def _fill_layer(
    cache: DynamicCache, layer: int, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> None:
    """Put the concatenated ``keys``/``values`` into an empty cache layer.

    ``DynamicLayer.update`` concatenates onto an empty tensor, which copies the whole
    prefix a second time, costing more than building it. An update with zero tokens
    lets transformers initialise the layer; a plain DynamicLayer then takes one
    concatenated tensor as it is; any other layer type gets the ordinary, copying update.
    """
    k0, v0 = keys[0], values[0]
    cache.update(k0[:, :, :0].flatten(2, -2), v0[:, :, :0].flatten(2, -2), layer)
    target = cache.layers[layer]
    if type(target) is DynamicLayer and target.get_seq_length() == 0:
        target.keys, target.values = concat_parts(keys), concat_parts(values)
        return
    cache.update(concat_parts(keys), concat_parts(values), layer)
