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


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


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
    ) -> list[bytes]:
        """The raw digests of every full block of ``tokens``, as vLLM computes them."""
        fn: Callable[[Any], bytes] = self._fn  # type: ignore[attr-defined]
        parent: bytes = self._none  # type: ignore[attr-defined]
        size = self.block_size
        lora_keys: list[Any] = [("lora", lora[0], lora[1])] if lora else []
        out: list[bytes] = []
        for start in range(0, len(tokens) - size + 1, size):
            keys = list(lora_keys)
            if start == 0 and cache_salt:
                keys.append(("cache_salt", cache_salt))
            extra = tuple(keys) if keys else None
            parent = fn((parent, tuple(tokens[start : start + size]), extra))
            out.append(parent)
        return out

    def keys(
        self,
        tokens: Sequence[int],
        *,
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
    ) -> list[BlockKey]:
        """The index keys of every full block of ``tokens``."""
        return [block_key(d) for d in self.digests(tokens, lora=lora, cache_salt=cache_salt)]
