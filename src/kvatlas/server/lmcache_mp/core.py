"""The vocabulary every part of the LMCache MP service shares: its identity, its
refusal (``MpError``), the KV groups of hybrid workers, and the keys of a request's
chunks (``ChunkKeys``).

Keys: LMCache's server hashes the ``IPCCacheServerKey``'s tokens with the blake3 prefix
chain (the same scheme and none-hash as ``kvatlas.core.keys``) and keys each chunk by
``(chunk hash, model, kv rank, object group 0, cache salt)`` with kv rank
``pack_kv_rank(world_size, worker, world_size, worker)``: exactly kvatlas' ObjectKey,
so chunks an LMCache client stores are found by the coordinator's directory, by P2P
peers and by kvatlas engines of the same contract, and the other way round.

Must not: hold state of a request, a worker or the store (``lookups``, ``workers``,
``store_side``), parse frames (``wire``) or import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from msgspec import structs

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey, chunk_hashes, pack_kv_rank
from kvatlas.core.types import ChunkHash
from kvatlas.server.lmcache_mp.cpu_kv import ChunkGeometry
from kvatlas.server.lmcache_mp.wire import IPCKey


class MpError(InvalidInput):
    """A request kvatlas refuses; ``reason`` is the counter label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class MpIdentity:
    instance_id: str
    incarnation: int
    chunk_size: int
    lease_s: float


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One LMCache KV group of a hybrid engine-driven worker (0.5.7 ``GroupLayout``):
    its chunks are ObjectKeys of object group = the group's index."""

    geometry: ChunkGeometry
    window_chunks: int = 0
    """The trailing chunks of a prefix this group needs for a hit (a sliding window's,
    or 1 for recurrent state); 0: every chunk (full attention)."""

    def first_needed(self, chunks: int) -> int:
        """The first chunk of a ``chunks``-chunk prefix this group must hold."""
        return 0 if self.window_chunks <= 0 else max(0, chunks - self.window_chunks)


PromptListener = Callable[[Sequence[int], Sequence[bytes], str], None]
"""Told the tokens, chunk hashes and cache salt of a prompt (must not block)."""


class ChunkKeys:
    """The ObjectKeys of an ``IPCKey``'s chunks, per rank and KV group."""

    def __init__(self, chunk_size: int, on_prompt: PromptListener | None = None) -> None:
        """``on_prompt``: told every prompt a lookup or a store names, so that the KV
        event publisher can publish the chunks stored from it with their tokens."""
        self._chunk_size = chunk_size
        self._on_prompt = on_prompt

    def hashes(self, key: IPCKey, start: int, end: int, learn: bool = False) -> list[bytes]:
        """The chunk hashes of ``[start, end)``; ``learn``: also show the prompt up to
        ``end`` to ``on_prompt`` (lookups and stores: the chunks a store makes)."""
        cs = self._chunk_size
        if start % cs or start < 0 or end < start:
            raise MpError("invalid", f"range [{start}, {end}) is not chunk-aligned ({cs})")
        tokens = key.token_ids[: min(end, len(key.token_ids))]
        try:
            hashes = chunk_hashes(tokens, cs)
        except InvalidInput as exc:
            raise MpError("invalid", str(exc)) from exc
        if learn and self._on_prompt is not None:
            self._on_prompt(tokens, [bytes(h) for h in hashes], key.cache_salt)
        return [bytes(h) for h in hashes[start // cs :]]

    def keys(
        self, key: IPCKey, start: int, end: int, rank: int, *, learn: bool = False
    ) -> list[ObjectKey]:
        """The chunk keys of ``[start, end)`` for ``rank``, in object group 0."""
        if key.world_size < 1 or not 0 <= rank < key.world_size:
            raise MpError("invalid", f"worker {rank} of world size {key.world_size}")
        kv_rank = pack_kv_rank(key.world_size, rank, key.world_size, rank)
        return [
            ObjectKey(ChunkHash(h), key.model_name, kv_rank, 0, key.cache_salt)
            for h in self.hashes(key, start, end, learn)
        ]

    def group_keys(
        self, key: IPCKey, start: int, end: int, rank: int, *, groups: int, learn: bool = False
    ) -> list[list[ObjectKey]]:
        """``keys`` in each of ``groups`` object groups (a hybrid worker's KV groups; the
        chunk hashes computed once)."""
        base = self.keys(key, start, end, rank, learn=learn)
        return [base] + [
            [structs.replace(k, object_group_id=g) for k in base] for g in range(1, groups)
        ]
