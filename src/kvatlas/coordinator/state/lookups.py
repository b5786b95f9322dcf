"""What the fleet holds of a prompt: lookups by tokens, hashes, keys, and blend.

Owns the token hash memo's use (hashing outside the lock) and the lookups' lock holds,
each covering only the directory's probes. Must not: change the fleet state, build
responses (the routes do), or know about HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvatlas.coordinator.state.fleet import LockedFleet
from kvatlas.core.coordinator.blend import BlendMatch
from kvatlas.core.coordinator.placements import KeyColumns, KeyResult, PrefixResult
from kvatlas.core.keys import ChainMemo, Namespace, ObjectKey, chunk_hashes
from kvatlas.core.types import ChunkHash


class Lookups:
    """Read the directory and the blend index, one short lock hold per lookup."""

    def __init__(self, state: LockedFleet, memo: ChainMemo | None = None) -> None:
        """``memo``: recent links of the token hash chain, for lookups by tokens
        (`--token-hash-memo-bytes`)."""
        self._state = state
        self._memo = memo

    def hash_tokens(self, tokens: Sequence[int] | bytes) -> list[ChunkHash]:
        """The prompt's chunk hashes; CPU work done outside the lock (the memo has its
        own, and a call that finds it taken hashes without it). The memo serves only the
        chunk size it was made for: once the fleet bound another, hashing goes without."""
        size = self._state.fleet.chunk_size
        memo = self._memo
        return chunk_hashes(
            tokens, size, memo=memo if memo is not None and memo.chunk_size == size else None
        )

    def prefix(self, hashes: Sequence[ChunkHash], ns: Namespace) -> PrefixResult:
        """Who holds the leading run of a prompt's chunk ``hashes``."""
        st = self._state
        with st.lock:
            return st.fleet.directory.lookup_prefix(hashes, ns)

    def blob(self, blob: bytes, ns: Namespace) -> KeyColumns:
        """Placements per hash of a blob of concatenated full hashes (the keys form)."""
        st = self._state
        with st.lock:
            return st.fleet.directory.lookup_blob(blob, ns)

    def keys(self, keys: Sequence[ObjectKey]) -> list[KeyResult]:
        """Placements of each of ``keys``."""
        st = self._state
        with st.lock:
            return st.fleet.lookup_keys(keys)

    @property
    def blend_enabled(self) -> bool:
        return self._state.fleet.blend is not None

    def blend(self, tokens: bytes, ns: Namespace) -> list[BlendMatch]:
        """Stored chunks found anywhere in ``tokens`` (`--enable-blend-lookup`)."""
        st = self._state
        with st.lock:
            return st.fleet.blend_lookup(tokens, ns)
