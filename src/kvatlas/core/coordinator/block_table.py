"""One vLLM engine's blocks, keyed by its block hashes and by content keys: the device
tier's table, and the token hashes lookups are made of.

Owns the content key of a block, a chain over token ids that needs no hash function or
seed from the engine (so a lookup costs a few XXH3 calls per block, not vLLM's
SHA-256 chain)::

    local_i   = XXH3_64(tokens of block i as uint32 little-endian, seed)
    content_i = XXH3_64(le64(content_{i-1}) || le64(local_i) || le64(extra_i), MIX_SEED)

``local_i`` is NVIDIA Dynamo's ``LocalBlockHash`` (seed 1337, plus ``XXH3_64(lora
name)`` for a LoRA: `lora_seed`), so Dynamo's ``/query_by_hash`` input chains into the
same keys. ``content_{-1}`` is the parent block's content key (0 for a prompt's first
block); ``extra_i`` is `extra_hash` of the block's extra keys as vLLM publishes them
(``extra_keys``: the cache salt on the first block, multimodal identifiers...), 0 when
there are none: a salted block never matches an unsalted or another tenant's prompt. A
content key of 0 is taken as 1; 0 means "unchained".

And `BlockTable`: per engine, block hash -> (content key, media mask, local hash, parent
hash), with an index of content keys for lookups. A store whose chain cannot be followed
(no token ids, or a parent the caller could not resolve) keeps its blocks unchained:
removals find them, lookups never match them. Copies of one (block, media bit) beyond
the first are counted apart (vLLM may cache one hash in several blocks of a group).

Two implementations with the same answers (tests hold them to each other): the compiled
`kvatlas.core._blocks` (XXH3 from the xxHash library vendored in third_party/xxhash;
dense 40-byte entries and two indexes of uint32 cells: about 48-56 bytes a block), and
the twin here over dicts and the `xxhash` package, used where the extension was not
built.

Must not: decode events, know vLLM's hash schemes (`kvatlas.core.vllm_hash`), or hold
a lock (the caller does).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import xxhash

from kvatlas.core.errors import InvalidInput

DYNAMO_SEED = 1337
"""Dynamo's ``XXH3_SEED``: the seed of a block's local hash."""
MIX_SEED = 0x6B7661746C6173
"""The seed of a content key's link ("kvatlas")."""
_MASK64 = (1 << 64) - 1
_LINK = struct.Struct("<QQQ")
_extra_encoder = msgspec.msgpack.Encoder()


def lora_seed(lora_name: str | None) -> int:
    """The local hash's seed for a LoRA (Dynamo's: its seed plus XXH3_64 of the name;
    an empty name is no LoRA)."""
    if not lora_name:
        return DYNAMO_SEED
    return (DYNAMO_SEED + xxhash.xxh3_64_intdigest(lora_name.encode())) & _MASK64


def extra_hash(items: Sequence[Any] | None) -> int:
    """A block's extra keys (vLLM's ``extra_keys`` entry, the LoRA name left out) as the
    ``extra_i`` of its content key; 0 for none."""
    if not items:
        return 0
    return xxhash.xxh3_64_intdigest(_extra_encoder.encode(list(items)), seed=MIX_SEED)


def salt_extras(cache_salt: str | None) -> list[int] | None:
    """The extras of a prompt salted with ``cache_salt`` (vLLM puts the salt in its
    first block's extra keys)."""
    return [extra_hash((cache_salt,))] if cache_salt else None


class BlockTableType(Protocol):
    """What both implementations offer."""

    def __len__(self) -> int: ...
    def store(  # noqa: PLR0917 (the compiled twin's positional signature)
        self,
        hashes: Sequence[int],
        parent: int | None,
        parent_content: int | None,
        tokens: Sequence[int] | None,
        block_size: int,
        seed: int,
        extras: Sequence[int] | None,
        bit: int,
        /,
    ) -> tuple[int, int]: ...
    def remove(self, hashes: Sequence[int], bit: int, /) -> int: ...
    def clear(self) -> int: ...
    def content(self, key: int, /) -> int | None: ...
    def mask(self, key: int, /) -> int: ...
    def run(self, keys: bytes, need: Sequence[int], /) -> tuple[int, int]: ...
    def masks(self, keys: bytes, /) -> list[int]: ...
    def items(self) -> list[tuple[int, int, int, int, int | None]]: ...
    @property
    def nbytes(self) -> int: ...


def _fold(mask: int) -> int:
    out = 0
    while mask:
        out |= mask & 15
        mask >>= 4
    return out


def _step(prev: int, local: int, extra: int) -> int:
    return xxhash.xxh3_64_intdigest(_LINK.pack(prev, local, extra), seed=MIX_SEED) or 1


def _tokens(tokens: Sequence[int] | bytes) -> list[int]:
    if isinstance(tokens, bytes | bytearray | memoryview):
        raw = bytes(tokens)
        if len(raw) % 4:
            raise ValueError("a token buffer holds whole uint32s")
        return list(struct.unpack(f"<{len(raw) // 4}I", raw))
    out = list(tokens)
    for t in out:
        if not isinstance(t, int):
            raise ValueError("token ids must be ints")
        if t < 0 or t > 0xFFFFFFFF:
            raise ValueError("token ids must be in [0, 2**32)")
    return out


def _local(tokens: list[int], start: int, size: int, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(
        struct.pack(f"<{size}I", *tokens[start : start + size]), seed=seed
    )


def _extra(extras: Sequence[int] | None, i: int) -> int:
    return extras[i] & _MASK64 if extras is not None and i < len(extras) else 0


def py_local_hashes(tokens: Sequence[int] | bytes, block_size: int, seed: int) -> bytes:
    """Every full block's local hash, as uint64 little-endian."""
    if block_size <= 0:
        raise ValueError(f"block size {block_size} must be positive")
    toks = _tokens(tokens)
    n = len(toks) // block_size
    return struct.pack(
        f"<{n}Q", *(_local(toks, b * block_size, block_size, seed) for b in range(n))
    )


def py_chain_locals(locals_: bytes, root: int, extras: Sequence[int] | None = None) -> bytes:
    """Content keys from local hashes (uint64 little-endian)."""
    if len(locals_) % 8:
        raise ValueError("local hashes are whole uint64s")
    out, prev = [], root & _MASK64
    for i, (local,) in enumerate(struct.iter_unpack("<Q", locals_)):
        prev = _step(prev, local, _extra(extras, i))
        out.append(prev)
    return struct.pack(f"<{len(out)}Q", *out)


def py_content_keys(
    tokens: Sequence[int] | bytes,
    block_size: int,
    seed: int,
    root: int,
    extras: Sequence[int] | None = None,
) -> bytes:
    """Every full block's content key, as uint64 little-endian."""
    return py_chain_locals(py_local_hashes(tokens, block_size, seed), root, extras)


class PyBlockTable:
    """The twin of `kvatlas.core._blocks.BlockTable` (see the module docstring)."""

    def __init__(self) -> None:
        self._e: dict[int, list[int]] = {}
        """hash -> [content, mask, local, parent (== hash: none)]"""
        self._index: dict[int, int] = {}
        """content -> hash (the latest block stored with that content)"""
        self._copies: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self._e)

    @property
    def nbytes(self) -> int:
        return 0  # not measured: Python objects

    def store(  # noqa: PLR0917 (the compiled twin's positional signature)
        self,
        hashes: Sequence[int],
        parent: int | None,
        parent_content: int | None,
        tokens: Sequence[int] | None,
        block_size: int,
        seed: int,
        extras: Sequence[int] | None,
        bit: int,
        /,
    ) -> tuple[int, int]:
        keys = [h & _MASK64 for h in hashes]
        n = len(keys)
        chained = True
        prev = 0
        if parent_content is not None:
            prev = parent_content & _MASK64
        elif parent is not None:
            chained = False
        toks: list[int] = []
        if tokens is None or block_size <= 0:
            chained = False
        else:
            toks = _tokens(tokens)
            if len(toks) < n * block_size:
                chained = False
        added = unchained = 0
        prev_key = parent & _MASK64 if parent is not None else 0
        for i, key in enumerate(keys):
            local = content = 0
            if chained:
                local = _local(toks, i * block_size, block_size, seed & _MASK64)
                content = prev = _step(prev, local, _extra(extras, i))
            own_parent = key if (i == 0 and parent is None) else prev_key
            e = self._e.get(key)
            if e is not None:
                if e[1] & bit:
                    self._copies[key, bit] = self._copies.get((key, bit), 0) + 1
                e[1] |= bit
                if content and not e[0]:
                    e[0], e[2], e[3] = content, local, own_parent
                    self._index[content] = key
                elif not e[0]:
                    unchained += 1
            else:
                self._e[key] = [content, bit, local, own_parent]
                added += 1
                if content:
                    self._index[content] = key
                else:
                    unchained += 1
            prev_key = key
        return added, unchained

    def remove(self, hashes: Sequence[int], bit: int, /) -> int:
        gone = 0
        for h in hashes:
            key = h & _MASK64
            if self._copies:
                extra = self._copies.pop((key, bit), 0)
                if extra:
                    if extra > 1:
                        self._copies[key, bit] = extra - 1
                    continue
            e = self._e.get(key)
            if e is None:
                continue
            e[1] &= ~bit
            if e[1]:
                continue
            if e[0] and self._index.get(e[0]) == key:
                del self._index[e[0]]
            del self._e[key]
            gone += 1
        return gone

    def clear(self) -> int:
        n = len(self._e)
        self._e.clear()
        self._index.clear()
        self._copies.clear()
        return n

    def content(self, key: int, /) -> int | None:
        e = self._e.get(key & _MASK64)
        return e[0] if e is not None and e[0] else None

    def mask(self, key: int, /) -> int:
        e = self._e.get(key & _MASK64)
        return e[1] if e is not None else 0

    def _mask_of(self, content: int) -> int | None:
        key = self._index.get(content)
        return None if key is None else self._e[key][1]

    def run(self, keys: bytes, need: Sequence[int], /) -> tuple[int, int]:
        if len(need) > 16:
            raise ValueError("at most 16 group masks")
        n, media = 0, _MASK64
        for (k,) in struct.iter_unpack("<Q", keys):
            m = self._mask_of(k)
            if m is None or not all(m & g for g in need):
                break
            media &= _fold(m)
            n += 1
        return n, media if n else 0

    def masks(self, keys: bytes, /) -> list[int]:
        return [self._mask_of(k) or 0 for (k,) in struct.iter_unpack("<Q", keys)]

    def items(self) -> list[tuple[int, int, int, int, int | None]]:
        return [(k, e[0], e[1], e[2], None if e[3] == k else e[3]) for k, e in self._e.items()]


BlockTable: type[BlockTableType]
local_hashes: Any
chain_locals: Any
content_keys: Any
try:
    from kvatlas.core import _blocks

    BlockTable = _blocks.BlockTable
    local_hashes = _blocks.local_hashes
    chain_locals = _blocks.chain_locals
    content_keys = _blocks.content_keys
    COMPILED = True
except ImportError:  # the extension was not built: the twin serves
    BlockTable = PyBlockTable
    local_hashes = py_local_hashes
    chain_locals = py_chain_locals
    content_keys = py_content_keys
    COMPILED = False


def prompt_keys(
    tokens: Sequence[int] | bytes,
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> bytes:
    """The content keys of a prompt's full blocks (uint64 little-endian), as a store of
    the same tokens with the same LoRA and salt keys them; `InvalidInput` for a token
    outside [0, 2**32)."""
    try:
        keys = content_keys(tokens, block_size, lora_seed(lora_name), 0, salt_extras(cache_salt))
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc
    return bytes(keys)
