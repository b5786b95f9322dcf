"""Keys: chunking, the blake3 prefix chain, object keys and the fleet's hash contract.

The hash contract is what every server of a fleet must agree on, or the fleet silently
never hits. This module owns the scheme (DESIGN.md section 2), which matches LMCache's so
that both compute the same hashes for the same tokens:

    none_hash = blake3(int64_be(0) || uint32_be(0))
    h_1       = blake3(none_hash || uint32_be(tokens of chunk 1))
    h_i       = blake3(h_{i-1}  || uint32_be(tokens of chunk i))

Only full chunks have keys; a trailing partial chunk is always recomputed.

Two implementations of the chain answer alike (a hypothesis test holds them to each
other): the compiled `kvatlas.core._chain` (the official BLAKE3 C library), built by
``pip install`` where the BLAKE3 C sources and a C compiler are found, and
`_python_chain`, a loop over the `blake3` package (slower, more so in a busy process),
which serves where it was not built.

The compiled chain can be given a `ChainMemo` (`chain_memo`): recent links as (parent
hash, chunk tokens) -> hash, compared byte for byte, so that a prompt looked up again (a
request the scheduler asks about while it waits, a chat's next turn, a shared system
prompt) is not hashed again (several times faster; docs/benchmarks.md holds the figures).
Its owner makes it and keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Final, Protocol

import msgspec
import numpy as np
import numpy.typing as npt
from blake3 import blake3

from kvatlas.core.errors import ContractMismatch, InvalidInput
from kvatlas.core.types import I64, ChunkHash

DEFAULT_CHUNK_SIZE: Final = 256

KV_DTYPE_SIZES: Final = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes per element of each KV dtype name a contract may declare."""
HASH_ALGORITHM: Final = "blake3"
HASH_BYTES: Final = 32
MAX_TOKEN_ID: Final = 2**32 - 1

NONE_HASH: Final = ChunkHash(blake3((0).to_bytes(8, "big") + (0).to_bytes(4, "big")).digest())

TokenArray = npt.NDArray[np.uint32]

ChainHasher = Callable[[bytes | TokenArray, int, bytes], bytes]
"""``(tokens as little-endian uint32, chunk size, prefix) -> the hashes of the full
chunks, concatenated``: the chain itself, for arguments already checked."""


class ChainMemo(Protocol):
    """A memo of recent links of the chain (`chain_memo`): the compiled module's
    ``ChainMemo``. ``stats()``: links found (hits) and missed (misses) since it was
    made, calls that found it in use by another thread and hashed without it (busy),
    and its size (links, bytes)."""

    @property
    def chunk_size(self) -> int: ...

    def stats(self) -> dict[str, int]: ...

    def clear(self) -> None: ...


_compiled_chain: Callable[..., bytes] | None
_MemoType: Callable[[int, int, bytes], ChainMemo] | None
try:
    from kvatlas.core._chain import ChainMemo as _MemoType
    from kvatlas.core._chain import chain as _compiled_chain
except ImportError:  # installed without the BLAKE3 C sources: the Python loop serves
    _compiled_chain = None
    _MemoType = None


def as_token_array(tokens: Sequence[int] | npt.NDArray[np.integer] | bytes) -> TokenArray:
    """Tokens as a uint32 array; ``bytes`` are read as little-endian uint32 (wire form).

    Raises InvalidInput for negative ids or ids that do not fit in uint32.
    """
    if isinstance(tokens, bytes | bytearray | memoryview):
        if len(tokens) % 4:
            raise InvalidInput("token bytes must be a multiple of 4 (little-endian uint32)")
        return np.frombuffer(tokens, dtype="<u4").astype(np.uint32, copy=False)
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            arr = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidInput(f"token ids must be integers: {exc}") from exc
    if arr.dtype == np.uint32:
        return arr.astype(np.uint32, copy=False)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise InvalidInput("token ids must be in [0, 2**32-1]")
    return arr.astype(np.uint32)


def chunk_hashes(
    tokens: Sequence[int] | npt.NDArray[np.integer] | bytes,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    prefix: ChunkHash = NONE_HASH,
    memo: ChainMemo | None = None,
) -> list[ChunkHash]:
    """The prefix-chain hashes of every full chunk of ``tokens``.

    ``prefix`` continues a chain (the hash of the chunk before the first token given).
    ``memo``: links to take the hashes from and to remember (`chain_memo`).
    """
    blob = chunk_hash_blob(tokens, chunk_size, prefix, memo=memo)
    return [ChunkHash(blob[i : i + HASH_BYTES]) for i in range(0, len(blob), HASH_BYTES)]


def chunk_hash_blob(
    tokens: Sequence[int] | npt.NDArray[np.integer] | bytes,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    prefix: ChunkHash = NONE_HASH,
    chain: ChainHasher | None = None,
    memo: ChainMemo | None = None,
) -> bytes:
    """`chunk_hashes` as one blob (the hashes concatenated, `HASH_BYTES` each): what the
    directory probes by, with no object per chunk. ``chain``: the implementation,
    `DEFAULT_CHAIN` unless given (tests hold each to the other). ``memo`` (made by
    `chain_memo`, so only where the compiled chain is) serves the compiled chain."""
    if chunk_size <= 0:
        raise InvalidInput(f"chunk size must be positive, got {chunk_size}")
    arr = as_token_array(tokens)
    if len(arr) < chunk_size:
        return b""
    if arr.dtype.byteorder == ">" or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype="<u4")
    if memo is not None and chain is None and _compiled_chain is not None:
        if memo.chunk_size != chunk_size:
            raise InvalidInput(f"the memo holds {memo.chunk_size}-token links, not {chunk_size}")
        return _compiled_chain(arr, chunk_size, bytes(prefix), memo)
    return (chain or DEFAULT_CHAIN)(arr, chunk_size, bytes(prefix))


def chain_memo(chunk_size: int, max_bytes: int, seed: bytes) -> ChainMemo | None:
    """A memo of recent links for the compiled chain, in at most ``max_bytes`` (the
    largest power of two of sets of 4 links that fits: one link takes 64 + 4 *
    ``chunk_size`` bytes); None where the compiled chain was not built or ``max_bytes``
    is 0. ``seed``: 32 random bytes, the keys of its slot picker (so that no sender can
    aim links at one slot). Raises InvalidInput when ``max_bytes`` is under one set.
    Safe to share between threads: a call that finds it busy hashes without it."""
    if _MemoType is None or max_bytes == 0:
        return None
    try:
        return _MemoType(chunk_size, max_bytes, seed)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


def _python_chain(tokens: bytes | TokenArray, chunk_size: int, prefix: bytes) -> bytes:
    """The chain over the `blake3` package: the twin of `_chain.chain`."""
    arr = np.frombuffer(tokens, dtype="<u4")
    n_full = len(arr) // chunk_size
    big_endian = arr[: n_full * chunk_size].astype(">u4").data.cast("B")
    step = chunk_size * 4
    out: list[bytes] = []
    prev = prefix
    hasher = blake3()  # reset and reused: building a hasher per chunk costs more
    for start in range(0, n_full * step, step):
        hasher.reset()
        hasher.update(prev)
        hasher.update(big_endian[start : start + step])
        prev = hasher.digest()
        out.append(prev)
    return b"".join(out)


CHAINS: Final[dict[str, ChainHasher]] = {"python": _python_chain}
if _compiled_chain is not None:
    CHAINS["compiled"] = _compiled_chain
"""The implementations of the chain this installation has, by name."""
DEFAULT_CHAIN_NAME: Final = "compiled" if "compiled" in CHAINS else "python"
"""The chain `chunk_hashes` uses: the compiled one where it was built."""
DEFAULT_CHAIN: Final = CHAINS[DEFAULT_CHAIN_NAME]


def pack_kv_rank(world_size: int, global_rank: int, local_world_size: int, local_rank: int) -> int:
    """``world_size<<24 | global_rank<<16 | local_world_size<<8 | local_rank``."""
    for name, value in (
        ("world_size", world_size),
        ("global_rank", global_rank),
        ("local_world_size", local_world_size),
        ("local_rank", local_rank),
    ):
        if not 0 <= value <= 0xFF:
            raise InvalidInput(f"{name} must be in [0, 255], got {value}")
    return world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank


def unpack_kv_rank(kv_rank: int) -> tuple[int, int, int, int]:
    """Inverse of pack_kv_rank: (world_size, global_rank, local_world_size, local_rank)."""
    return (kv_rank >> 24 & 0xFF, kv_rank >> 16 & 0xFF, kv_rank >> 8 & 0xFF, kv_rank & 0xFF)


def default_kv_rank(world_size: int = 1) -> int:
    """kv rank of rank 0 in a single-node group of ``world_size`` (1 → 16777472)."""
    return pack_kv_rank(world_size, 0, world_size, 0)


def rank_keys(
    hashes: Sequence[ChunkHash], model_name: str, world_size: int, cache_salt: str = ""
) -> list[ObjectKey]:
    """Every rank's key of each chunk, chunk-major, in object group 0: what LMCache's
    ``resolve_object_keys`` makes of a token-addressed request (one key per worker of a
    single-node group of ``world_size``)."""
    ranks = [pack_kv_rank(world_size, r, world_size, r) for r in range(world_size)]
    return [ObjectKey(h, model_name, rank, 0, cache_salt) for h in hashes for rank in ranks]


class Namespace(msgspec.Struct, frozen=True, gc=False):
    """Everything of an object key but the chunk hash: the scope hashes live in."""

    model_name: str
    kv_rank: I64
    object_group_id: I64 = 0
    cache_salt: str = ""


class ObjectKey(msgspec.Struct, frozen=True, gc=False):
    """Identity of one stored KV object (a chunk of one rank of one model)."""

    chunk_hash: bytes
    model_name: str
    kv_rank: I64
    object_group_id: I64 = 0
    cache_salt: str = ""

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.model_name, self.kv_rank, self.object_group_id, self.cache_salt)

    @property
    def chunk_hash_hex(self) -> str:
        return self.chunk_hash.hex()


_NS_FIELDS: Final = tuple(
    map(attrgetter, ("model_name", "kv_rank", "object_group_id", "cache_salt"))
)


def same_namespace(keys: Sequence[ObjectKey]) -> bool:
    """True when every key has the namespace of the first one (also for no keys).

    One C-level pass per namespace field, compared as a list: no tuple or Namespace per
    key and no hashing (ingest runs this for every batch of the entries form).
    """
    if not keys:
        return True
    n = len(keys)
    first = keys[0]
    return all(list(map(get, keys)) == [get(first)] * n for get in _NS_FIELDS)


def salted(ns: Namespace, cache_salt: str) -> Namespace:
    """``ns`` under ``cache_salt``: a request's salt is part of every key of its KV (as
    in LMCache's keys), so equal tokens under two salts are two keys, at every tier."""
    if ns.cache_salt == cache_salt:
        return ns
    return Namespace(ns.model_name, ns.kv_rank, ns.object_group_id, cache_salt)


def object_keys(hashes: Sequence[ChunkHash], ns: Namespace) -> list[ObjectKey]:
    """Object keys of ``hashes`` in namespace ``ns``."""
    return [
        ObjectKey(h, ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt) for h in hashes
    ]


class HashContract(msgspec.Struct, frozen=True):
    """What a fleet must agree on so that equal tokens give equal keys and usable bytes.

    Servers declare it when they register; the coordinator refuses a contract that
    contradicts the fleet's for the same model.
    """

    model_name: str
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_algorithm: str = HASH_ALGORITHM
    kv_dtype: str = ""
    kv_layout: tuple[int, int, int] = (0, 0, 0)
    """(layers, kv heads, head dim); zeros mean "not declared"."""
    world_size: int = 1

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one chunk: layers x (K, V) x kv heads x chunk size x head dim x dtype.

        Raises InvalidInput when the contract declares no layout or an unknown dtype.
        """
        layers, heads, head_dim = self.kv_layout
        size = KV_DTYPE_SIZES.get(self.kv_dtype)
        if size is None or min(layers, heads, head_dim, self.chunk_size) <= 0:
            raise InvalidInput(
                f"contract of {self.model_name!r} declares no usable KV layout"
                f" (dtype {self.kv_dtype!r}, layout {self.kv_layout})"
            )
        return layers * 2 * heads * self.chunk_size * head_dim * size

    def mismatch(self, other: HashContract) -> str | None:
        """Name of the first field on which ``other`` contradicts this contract, or None."""
        for field in self.__struct_fields__:
            if getattr(self, field) != getattr(other, field):
                return field
        return None

    def check_compatible(self, other: HashContract) -> None:
        """Raise ContractMismatch naming the first differing field."""
        field = self.mismatch(other)
        if field is not None:
            raise ContractMismatch(field, getattr(self, field), getattr(other, field))
