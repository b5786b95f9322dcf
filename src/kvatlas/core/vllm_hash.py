"""vLLM's prefix-cache block hashes, computed from token ids without importing vLLM.

Owns the scheme of ``vllm.v1.core.kv_cache_utils`` (``hash_block_tokens`` over
``get_request_block_hasher``): block ``i`` hashes ``(parent, tuple(block_tokens),
extra_keys)`` with the engine's ``--prefix-caching-hash-algo`` (``sha256``: pickle
protocol 5 then SHA-256; ``sha256_cbor``: canonical CBOR then SHA-256; ``xxhash`` /
``xxhash_cbor``: XXH3-128 of the same), the first parent being ``NONE_HASH =
hash_fn(seed)`` (seed ``"vllm-none-hash"``, or the engine's ``PYTHONHASHSEED`` when
set: the xxhash variants need it, their default seed is random per process). Extra keys
are ``("lora", name, path)`` on every block of a LoRA request and ``("cache_salt",
salt)`` on the first block. Only full blocks hash. Keys come out as
`kvatlas.core.device_blocks.BlockKey` (the digest's low 64 bits), the form events are
indexed by.

`DigestMemo` remembers recent blocks' digests by (parent digest, the block's tokens,
its extra keys), exactly the inputs of the hash, so a prompt sharing a prefix with a
recent one hashes only its new blocks (routers ask about the same prefixes again and
again).

Must not: hash multimodal or prompt-embedding requests (their extra keys need the
media), or depend on vLLM (it is no dependency of kvatlas; tests check equality with
vLLM's own functions).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvatlas.core.device_blocks import BlockKey, block_key
from kvatlas.core.errors import ConfigError, InvalidInput

DEFAULT_SEED = "vllm-none-hash"
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def cbor_canonical(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 4.2.1) of None, bool, int, str, bytes and tuples/lists
    of them: the subset block-hash inputs use, byte-equal to ``cbor2.dumps(obj,
    canonical=True)``."""
    out = bytearray()
    _cbor(obj, out)
    return bytes(out)


def _head(major: int, n: int, out: bytearray) -> None:
    m = major << 5
    if n < 24:
        out.append(m | n)
    elif n < 1 << 8:
        out += bytes((m | 24, n))
    elif n < 1 << 16:
        out.append(m | 25)
        out += struct.pack(">H", n)
    elif n < 1 << 32:
        out.append(m | 26)
        out += struct.pack(">I", n)
    elif n < 1 << 64:
        out.append(m | 27)
        out += struct.pack(">Q", n)
    else:
        raise InvalidInput(f"integer {n} too large for the block hash")


def _cbor(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        if obj >= 0:
            _head(0, obj, out)
        else:
            _head(1, -1 - obj, out)
    elif isinstance(obj, bytes):
        _head(2, len(obj), out)
        out += obj
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        _head(3, len(raw), out)
        out += raw
    elif isinstance(obj, tuple | list):
        _head(4, len(obj), out)
        for item in obj:
            _cbor(item, out)
    else:
        raise InvalidInput(f"cannot hash a {type(obj).__name__} in a block key")


def cbor_uint_items(tokens: Sequence[int]) -> tuple[bytes, list[int]]:
    """Every token's canonical CBOR item, concatenated, and the offset of each (plus the
    end): one numpy pass for a whole prompt, so that a block's token array is a slice
    (much faster than an item by item encode)."""
    try:
        a = np.asarray(tokens, dtype=np.int64)
    except OverflowError as exc:
        raise InvalidInput("token ids must be in [0, 2**32)") from exc
    if a.size and (int(a.min()) < 0 or int(a.max()) >= 1 << 32):
        raise InvalidInput("token ids must be in [0, 2**32)")
    a = a.astype(np.uint64)
    small, one, two = a < 24, a < 256, a < 65536
    lens = np.where(small, 1, np.where(one, 2, np.where(two, 3, 5))).astype(np.int64)
    offs = np.zeros(a.size + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    buf = np.zeros(int(offs[-1]), dtype=np.uint8)
    start = offs[:-1]
    buf[start] = np.where(small, a, np.where(one, 24, np.where(two, 25, 26))).astype(np.uint8)
    for width in (1, 2, 4):
        m = lens == width + 1
        at, v = start[m], a[m]
        for i in range(width):
            buf[at + 1 + i] = ((v >> np.uint64(8 * (width - 1 - i))) & np.uint64(255)).astype(
                np.uint8
            )
    return buf.tobytes(), offs.tolist()


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _digest_function(name: str) -> Callable[[bytes], bytes] | None:
    """The digest under a CBOR algorithm (None for the pickle ones)."""
    if name == "sha256_cbor":
        return lambda b: hashlib.sha256(b).digest()
    if name == "xxhash_cbor":
        return xxhash.xxh3_128_digest
    return None


def hash_function(name: str) -> Callable[[Any], bytes]:
    """The hash function vLLM names ``name`` (``--prefix-caching-hash-algo``)."""
    if name == "sha256":
        return lambda o: hashlib.sha256(_pickled(o)).digest()
    if name == "sha256_cbor":
        return lambda o: hashlib.sha256(cbor_canonical(o)).digest()
    if name == "xxhash":
        return lambda o: xxhash.xxh3_128_digest(_pickled(o))
    if name == "xxhash_cbor":
        return lambda o: xxhash.xxh3_128_digest(cbor_canonical(o))
    raise ConfigError(f"unknown vLLM hash algorithm {name!r}; one of {', '.join(HASH_ALGOS)}")


class DigestMemo:
    """Block digests by their hash inputs, at most ``max_entries`` (then it starts over:
    a cheap bound, no LRU bookkeeping). Safe to share between threads: each of its
    steps is one dict operation."""

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._digests: dict[tuple[bytes, bytes, Any], bytes] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[bytes, bytes, Any]) -> bytes | None:
        d = self._digests.get(key)
        if d is None:
            self.misses += 1
        else:
            self.hits += 1
        return d

    def put(self, key: tuple[bytes, bytes, Any], digest: bytes) -> None:
        if len(self._digests) >= self.max_entries:
            self._digests.clear()
        self._digests[key] = digest

    def __len__(self) -> int:
        return len(self._digests)


def _raw_tokens(tokens: Sequence[int]) -> bytes | None:
    """The tokens as int64 bytes (a block's slice is its memo key); None when one does
    not fit (such a prompt is hashed without the memo)."""
    try:
        return np.asarray(tokens, dtype=np.int64).tobytes()
    except OverflowError:
        return None


@dataclass(frozen=True)
class BlockHasher:
    """One engine's hash contract: algorithm, seed and block size."""

    algo: str = "sha256"
    seed: str = DEFAULT_SEED
    block_size: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "_fn", hash_function(self.algo))
        if self.block_size <= 0:
            raise ConfigError(f"block size {self.block_size} must be positive")
        object.__setattr__(self, "_none", self._fn(self.seed))  # type: ignore[attr-defined]

    def digests(
        self,
        tokens: Sequence[int],
        *,
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
        memo: DigestMemo | None = None,
    ) -> list[bytes]:
        """The raw digests of every full block of ``tokens``, as vLLM computes them
        (those ``memo`` remembers taken from it, the others put in it)."""
        fn: Callable[[Any], bytes] = self._fn  # type: ignore[attr-defined]
        parent: bytes = self._none  # type: ignore[attr-defined]
        size = self.block_size
        full = len(tokens) // size * size
        lora_keys: list[Any] = [("lora", lora[0], lora[1])] if lora else []
        raw = _raw_tokens(tokens[:full]) if memo is not None else None
        out: list[bytes] = []
        digest = _digest_function(self.algo)
        cbor: tuple[bytes, list[int]] | None = None
        base = 0  # the first token the CBOR items cover
        tokens_head = bytearray()
        _head(4, size, tokens_head)
        for start in range(0, full, size):
            keys = list(lora_keys)
            if start == 0 and cache_salt:
                keys.append(("cache_salt", cache_salt))
            extra = tuple(keys) if keys else None
            key = None
            if memo is not None and raw is not None:
                key = (parent, raw[start * 8 : (start + size) * 8], extra)
                known = memo.get(key)
                if known is not None:
                    parent = known
                    out.append(parent)
                    continue
            if digest is not None:
                # CBOR of (parent, tokens, extra) built from pieces: the token items
                # come from one pass over the rest of the prompt (made at the first block
                # the memo did not hold). Equal to cbor_canonical of the tuple.
                if cbor is None:
                    base = start
                    cbor = cbor_uint_items(tokens[start:full])
                items, offs = cbor
                head = bytearray(b"\x83")
                _cbor(parent, head)
                head += tokens_head
                tail = cbor_canonical(extra)
                at = start - base
                parent = digest(bytes(head) + items[offs[at] : offs[at + size]] + tail)
            else:
                parent = fn((parent, tuple(tokens[start : start + size]), extra))
            if key is not None and memo is not None:
                memo.put(key, parent)
            out.append(parent)
        return out

    def keys(
        self,
        tokens: Sequence[int],
        *,
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
        memo: DigestMemo | None = None,
    ) -> list[BlockKey]:
        """The index keys of every full block of ``tokens``."""
        digests = self.digests(tokens, lora=lora, cache_salt=cache_salt, memo=memo)
        return [block_key(d) for d in digests]
