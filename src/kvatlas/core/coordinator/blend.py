"""The blend index: position-independent discovery of cached chunks in a new sequence.

Owns, per namespace, a fingerprint of every stored full chunk's tokens and the tokens
themselves (one little-endian uint32 ``bytes`` per chunk), so that a chunk cached at any
position of any earlier sequence can be found inside a new one and verified token for
token. It only discovers: reusing a chunk at another position needs the engine's blending
(re-RoPE, partial recompute), and who holds a chunk is the key directory's business. The
caller adds a chunk when it learns its tokens and removes it when its last placement goes.

Fingerprint: the polynomial hash ``sum_j t[j] * B**j mod 2**64`` of a chunk's tokens, with
an odd base ``B`` (so ``B`` is invertible mod 2**64). It depends on the tokens only, not on
where they stood. A lookup computes it for every window of ``chunk_size`` tokens of the
query at once with numpy prefix sums in wrapping uint64 arithmetic:

    P[k]   = sum_{m<k} t[m] * B**m
    H(i)   = (P[i+n] - P[i]) * B**-i        (the fingerprint of window i)

Equal fingerprints are only candidates: every match is verified against the stored tokens,
so a fingerprint collision costs a comparison and can never produce a wrong match.

Must not: do I/O, read clocks, or know about placements, instances or tiers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import DEFAULT_CHUNK_SIZE, Namespace, TokenArray, as_token_array

DEFAULT_BASE: Final = 0x9E3779B97F4A7C15
"""Odd 64-bit multiplier (the golden-ratio constant); any odd base is a valid hash."""

_MOD: Final = 1 << 64
_MIN_SLOT_BITS: Final = 10
_U64 = npt.NDArray[np.uint64]


class BlendMatch(msgspec.Struct, frozen=True, gc=False):
    """A stored chunk found inside a query: its tokens stood at ``old_st`` when stored and
    stand at ``cur_st`` in the query."""

    chunk_hash: bytes
    old_st: int
    cur_st: int


class BlendStats(msgspec.Struct, frozen=True, gc=False):
    """Size of the index, for metrics."""

    chunks: int
    namespaces: int
    token_bytes: int


class _Chunk(msgspec.Struct, frozen=True, gc=False):
    tokens: bytes
    """Little-endian uint32 token ids, exactly ``chunk_size`` of them."""
    start: int
    fingerprint: int


class _Space:
    """The chunks of one namespace, by chunk hash and by fingerprint.

    ``occupied`` counts fingerprints per slot (the fingerprint's top bits, the best mixed
    ones of a polynomial hash); a lookup filters its windows through it in numpy so that
    only about one window in eight or fewer reaches a Python dict lookup. It holds at
    least eight slots per chunk and doubles as chunks arrive: a few bytes per chunk. It
    never shrinks; a namespace whose last chunk goes is dropped whole.
    """

    __slots__ = ("by_fingerprint", "chunks", "occupied", "shift")

    def __init__(self) -> None:
        self.chunks: dict[bytes, _Chunk] = {}
        self.by_fingerprint: dict[int, list[bytes]] = {}
        self.shift = 64 - _MIN_SLOT_BITS
        self.occupied: npt.NDArray[np.uint32] = np.zeros(1 << _MIN_SLOT_BITS, dtype=np.uint32)

    def put(self, chunk_hash: bytes, chunk: _Chunk) -> None:
        self.drop(chunk_hash)
        self.chunks[chunk_hash] = chunk
        self.by_fingerprint.setdefault(chunk.fingerprint, []).append(chunk_hash)
        if 8 * len(self.chunks) > len(self.occupied):
            self._resize(self.shift - 1)
        else:
            self.occupied[chunk.fingerprint >> self.shift] += 1

    def drop(self, chunk_hash: bytes) -> _Chunk | None:
        chunk = self.chunks.pop(chunk_hash, None)
        if chunk is not None:
            self.occupied[chunk.fingerprint >> self.shift] -= 1
            bucket = self.by_fingerprint[chunk.fingerprint]
            bucket.remove(chunk_hash)
            if not bucket:
                del self.by_fingerprint[chunk.fingerprint]
        return chunk

    def maybe_known(self, fingerprints: _U64) -> npt.NDArray[np.intp]:
        """Positions of the fingerprints whose slot holds any chunk (a superset of hits)."""
        hit: npt.NDArray[np.intp] = np.flatnonzero(self.occupied[fingerprints >> self.shift])
        return hit

    def _resize(self, shift: int) -> None:
        fingerprints = np.fromiter(
            (c.fingerprint for c in self.chunks.values()), dtype=np.uint64, count=len(self.chunks)
        )
        self.shift = shift
        slots = (fingerprints >> np.uint64(shift)).astype(np.intp)
        counts = np.bincount(slots, minlength=1 << (64 - shift))
        self.occupied = counts.astype(np.uint32)


class BlendIndex:
    """Fingerprints of stored chunks, scoped by namespace, searchable at any offset.

    Non-overlap policy of ``lookup``: windows are scanned left to right and a window
    matches only if it starts at or after the end of the previous match
    (``cur_st >= previous cur_st + chunk_size``). With equal-length windows this greedy
    choice returns the largest possible number of non-overlapping matches. When several
    stored chunks have exactly the window's tokens (the same text cached at different
    positions), the one with the smallest ``|old_st - cur_st|`` (least re-positioning)
    wins, ties broken by the smallest chunk hash, so results are deterministic.
    """

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE, *, base: int = DEFAULT_BASE) -> None:
        """``base`` is the fingerprint's multiplier; it must be odd. Tests pass ``base=1``
        (fingerprint = token sum) to force collisions."""
        if chunk_size <= 0:
            raise InvalidInput(f"chunk size must be positive, got {chunk_size}")
        if not 0 < base < _MOD or base % 2 == 0:
            raise InvalidInput(f"blend fingerprint base must be odd and below 2**64, got {base}")
        self._chunk_size = chunk_size
        self._base = base
        self._inverse = pow(base, -1, _MOD)
        self._spaces: dict[Namespace, _Space] = {}
        self._count = 0
        self._powers = np.ones(1, dtype=np.uint64)
        self._inverse_powers = np.ones(1, dtype=np.uint64)

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    def __len__(self) -> int:
        return self._count

    def add(
        self,
        ns: Namespace,
        chunk_hash: bytes,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        start: int,
    ) -> bool:
        """Index one stored full chunk whose first token stood at ``start``.

        An upsert: adding a chunk hash again replaces its tokens and start. Returns False,
        indexing nothing, when ``tokens`` is not exactly one full chunk (a partial chunk
        has no key). Raises InvalidInput for a negative start or invalid token ids.
        """
        if start < 0:
            raise InvalidInput(f"chunk start must be >= 0, got {start}")
        arr = as_token_array(tokens)
        if arr.ndim != 1 or len(arr) != self._chunk_size:
            return False
        key = bytes(chunk_hash)
        chunk = _Chunk(arr.astype("<u4").tobytes(), start, self._fingerprint(arr))
        space = self._spaces.setdefault(ns, _Space())
        if key not in space.chunks:
            self._count += 1
        space.put(key, chunk)
        return True

    def remove(self, ns: Namespace, chunk_hash: bytes) -> bool:
        """Forget a chunk; False if it was not indexed in ``ns``."""
        space = self._spaces.get(ns)
        if space is None or space.drop(chunk_hash) is None:
            return False
        self._count -= 1
        if not space.chunks:
            del self._spaces[ns]
        return True

    def lookup(
        self, ns: Namespace, tokens: Sequence[int] | npt.NDArray[np.integer] | bytes
    ) -> list[BlendMatch]:
        """Stored chunks of ``ns`` found anywhere in ``tokens``, ascending by ``cur_st``.

        Every match is verified token for token; see the class docstring for the
        non-overlap policy.
        """
        space = self._spaces.get(ns)
        arr = as_token_array(tokens)
        n = self._chunk_size
        if space is None or arr.ndim != 1 or len(arr) < n:
            return []
        fingerprints = self._window_fingerprints(arr)
        known = space.by_fingerprint
        maybe = space.maybe_known(fingerprints)
        candidates = [
            cur
            for cur, fp in zip(maybe.tolist(), fingerprints[maybe].tolist(), strict=True)
            if fp in known
        ]
        if not candidates:
            return []
        query = arr.astype("<u4", copy=False).tobytes()
        out: list[BlendMatch] = []
        free_from = 0
        for cur in candidates:
            if cur < free_from:
                continue
            window = query[4 * cur : 4 * (cur + n)]
            best: tuple[int, bytes, int] | None = None
            for chunk_hash in known[int(fingerprints[cur])]:
                chunk = space.chunks[chunk_hash]
                if chunk.tokens != window:
                    continue
                rank = (abs(chunk.start - cur), chunk_hash, chunk.start)
                if best is None or rank < best:
                    best = rank
            if best is not None:
                out.append(BlendMatch(best[1], best[2], cur))
                free_from = cur + n
        return out

    def stats(self) -> BlendStats:
        return BlendStats(
            chunks=self._count,
            namespaces=len(self._spaces),
            token_bytes=self._count * self._chunk_size * 4,
        )

    def snapshot_items(self) -> Iterator[tuple[Namespace, bytes, TokenArray, int]]:
        """Every indexed chunk as ``(ns, chunk_hash, tokens, start)``; replaying them
        through ``add`` rebuilds the index. The token arrays are read-only views."""
        for ns, space in self._spaces.items():
            for chunk_hash, chunk in space.chunks.items():
                tokens = np.frombuffer(chunk.tokens, dtype="<u4").astype(np.uint32, copy=False)
                yield ns, chunk_hash, tokens, chunk.start

    def _fingerprint(self, tokens: TokenArray) -> int:
        products = tokens.astype(np.uint64) * self._power_table(len(tokens))[0][: len(tokens)]
        return int(products.sum(dtype=np.uint64))

    def _window_fingerprints(self, tokens: TokenArray) -> _U64:
        """Fingerprint of every window of ``chunk_size`` tokens (wrapping uint64)."""
        n = self._chunk_size
        length = len(tokens)
        powers, inverse_powers = self._power_table(length)
        prefix = np.zeros(length + 1, dtype=np.uint64)
        np.cumsum(tokens.astype(np.uint64) * powers[:length], out=prefix[1:])
        windows = length - n + 1
        result: _U64 = (prefix[n:] - prefix[:windows]) * inverse_powers[:windows]
        return result

    def _power_table(self, length: int) -> tuple[_U64, _U64]:
        """``B**m`` and ``B**-m`` mod 2**64 for ``m < length`` (grown geometrically)."""
        if len(self._powers) < length:
            size = max(length, 2 * len(self._powers))
            self._powers = _geometric(self._base, size)
            self._inverse_powers = _geometric(self._inverse, size)
        return self._powers, self._inverse_powers


def _geometric(ratio: int, size: int) -> _U64:
    """``[ratio**0, ..., ratio**(size-1)]`` mod 2**64, by cumulative product."""
    factors = np.full(size, ratio, dtype=np.uint64)
    factors[0] = 1
    out: _U64 = np.cumprod(factors, dtype=np.uint64)
    return out
