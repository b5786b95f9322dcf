"""A kvatlas server's chunk changes as the vLLM block events an engine publishes for the
same tokens (`ChunkBlocks`, owned by `kvatlas.server.kv_events`' publisher thread):

* a chunk's first STORE in a tier -> ``BlockStored`` of its ``chunk_size / block_size``
  engine blocks (``--kv-events-block-size``): ``block_size`` token ids each, block hashes
  as vLLM computes them over the chunk's whole token prefix (`core.vllm_hash.BlockHasher`
  with ``--kv-events-hash-algo`` and ``--kv-events-hash-seed``) in the integer form vLLM
  publishes by default (the digest's low 64 bits, `core.device_blocks.block_key`),
  ``parent_block_hash`` the block before the first (None at a prompt's start), medium
  ``CPU`` for L1 and ``STORAGE`` for L2;
* its last DELETE there (evicted, deleted, moved) -> ``BlockRemoved`` of those blocks.

The store never holds a chunk's tokens, so they come from the prompts the server is
shown (`ChunkBlocks.learn`); a chunk stored while no recent prompt showed its tokens is
withheld, counted, and published once a prompt shows them. The module docstring of
`kvatlas.server.kv_events` says why, what salted chunks become, and the memory this
keeps.

Pure and single-threaded: no sockets, clocks or logging.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvatlas.core.device_blocks import block_key
from kvatlas.core.errors import ConfigError, InvalidInput
from kvatlas.core.events import Entry
from kvatlas.core.keys import ObjectKey, as_token_array
from kvatlas.core.types import EventType, Tier
from kvatlas.core.vllm_hash import BlockHasher, DigestMemo
from kvatlas.wire.vllm_events import EventOut, RemovedOut, StoredOut

MEDIUM_OF_TIER = {Tier.L1: "CPU", Tier.L2: "STORAGE"}
"""vLLM's ``MEDIUM_CPU`` and ``MEDIUM_STORAGE`` (its CPU and disk offload tiers)."""
TIERS = tuple(MEDIUM_OF_TIER)
MEMO_BLOCKS = 16_384
"""Block digests `ChunkBlocks` remembers across prompts (about 330 bytes each)."""

Tokens = bytes | Sequence[int] | npt.NDArray[np.integer]
"""A prompt's token ids: little-endian uint32 bytes (the engine API's wire form) or ints."""
_CKey = tuple[str, bytes]
"""A chunk as readers see it: (cache salt, chunk hash)."""


@dataclass(slots=True)
class _Blocks:
    """One chunk as the engine blocks it holds."""

    keys: array[int]
    """Their hashes, in order (``"Q"``: 8 bytes each)."""
    parent: int | None
    """The hash of the block before the first; None: the chunk starts its prompt."""
    tokens: bytes | None
    """Little-endian uint32; None for a salted chunk (published without them)."""


@dataclass(slots=True, eq=False)
class _Prompt:
    """A prompt shown to the publisher, kept while a chunk of it waits to be stored."""

    tokens: bytes
    """Its full chunks' tokens, little-endian uint32."""
    salt: str
    live: int = 0
    """Waiting chunks that point here."""
    keys: array[int] | None = None
    """Every full block's hash (``"Q"``), once a chunk of it was needed: the prompt is
    hashed once for all its chunks."""


_Known = _Blocks | tuple[_Prompt, int]
"""A chunk not held by any tier whose blocks are known: computed, or chunk i of a prompt."""


@dataclass(frozen=True, slots=True)
class BlockCounts:
    """What `ChunkBlocks` has done and holds."""

    blocks_stored: int
    blocks_removed: int
    chunks_withheld: int
    """Chunk stores not published: their tokens were unknown."""
    blocks: int
    """(Block, medium) pairs its subscribers are told this server holds."""
    unpublished: int
    """(Chunk, medium) pairs held but not published (tokens unknown)."""
    prompt_tokens: int
    """Tokens kept for chunks no tier holds (prompts waiting, chunks demoted or evicted)."""


class ChunkBlocks:
    """The store's chunk changes as vLLM block events (see the module doc). Pure and
    single-threaded: the publisher's thread owns it."""

    def __init__(self, chunk_size: int, hasher: BlockHasher, prompt_tokens: int) -> None:
        if chunk_size <= 0 or chunk_size % hasher.block_size:
            raise ConfigError(
                f"--kv-events-block-size {hasher.block_size} must divide --chunk-size {chunk_size}"
            )
        self.chunk_size = chunk_size
        self.hasher = hasher
        self._per_chunk = chunk_size // hasher.block_size
        self._budget = prompt_tokens
        self._memo = DigestMemo(MEMO_BLOCKS)
        self._held: dict[tuple[Tier, _CKey], set[ObjectKey]] = {}
        self._blocks: dict[_CKey, _Blocks] = {}
        """Chunks some tier holds, with their blocks (published wherever held)."""
        self._unpublished: set[tuple[Tier, _CKey]] = set()
        self._known: OrderedDict[_CKey, _Known] = OrderedDict()
        """Chunks no tier holds whose blocks are known, oldest first."""
        self._kept = 0
        self._stored = self._removed = self._withheld = self._published = 0

    # -- the two ways in -----------------------------------------------------------------

    def learn(self, tokens: Tokens, hashes: Sequence[bytes], cache_salt: str) -> list[EventOut]:
        """A prompt's tokens and the chunk hashes of its full chunks: its chunks held but
        unpublished are published now (returned), the others remembered until stored.
        Raises InvalidInput when there are not as many full chunks as hashes."""
        raw = as_token_array(tokens).astype("<u4", copy=False).tobytes()
        n = len(hashes)
        if len(raw) < n * self.chunk_size * 4:
            raise InvalidInput(
                f"{n} chunk hashes for {len(raw) // 4} tokens of {self.chunk_size}-token chunks"
            )
        prompt = _Prompt(raw[: n * self.chunk_size * 4], cache_salt)
        out: list[EventOut] = []
        for i, h in enumerate(hashes):
            ck = (cache_salt, bytes(h))
            if ck in self._blocks:
                continue
            held = [t for t in TIERS if (t, ck) in self._unpublished]
            if not held:
                self._keep(ck, (prompt, i))
                continue
            blocks = self._blocks[ck] = self._resolve(prompt, i)
            for tier in held:
                self._unpublished.discard((tier, ck))
                self._emit_stored(out, blocks, MEDIUM_OF_TIER[tier])
        self._trim()
        return out

    def apply(self, event_type: EventType, tier: Tier, entries: Sequence[Entry]) -> list[EventOut]:
        """One batch of store changes (STORE or DELETE; others change nothing)."""
        medium = MEDIUM_OF_TIER[tier]
        out: list[EventOut] = []
        removed: list[int] = []
        for e in entries:
            ck = (e.key.cache_salt, e.key.chunk_hash)
            place = (tier, ck)
            keys = self._held.get(place)
            if event_type is EventType.STORE:
                if keys is not None:
                    keys.add(e.key)
                    continue
                self._held[place] = {e.key}
                blocks = self._blocks.get(ck) or self._take_known(ck)
                if blocks is None:
                    self._unpublished.add(place)
                    self._withheld += 1
                else:
                    self._emit_stored(out, blocks, medium)
            elif event_type is EventType.DELETE and keys is not None:
                keys.discard(e.key)
                if keys:
                    continue
                del self._held[place]
                if place in self._unpublished:
                    self._unpublished.discard(place)
                else:
                    gone = self._blocks[ck].keys
                    removed.extend(gone)
                    self._removed += len(gone)
                    self._published -= len(gone)
                if all((t, ck) not in self._held for t in TIERS):
                    blocks = self._blocks.pop(ck, None)
                    if blocks is not None:  # a demotion stores it in the next tier
                        self._keep(ck, blocks)
        if removed:
            out.append(RemovedOut(removed, medium))
        self._trim()
        return out

    def clear(self) -> None:
        """Forget what subscribers were told (they are sent ``AllBlocksCleared``): every
        chunk held becomes a known one, which the owner's republish stores again."""
        for ck, blocks in self._blocks.items():
            self._keep(ck, blocks)
        self._blocks.clear()
        self._held.clear()
        self._unpublished.clear()
        self._published = 0
        self._trim()

    def counts(self) -> BlockCounts:
        return BlockCounts(
            self._stored,
            self._removed,
            self._withheld,
            self._published,
            len(self._unpublished),
            self._kept,
        )

    # -- blocks ----------------------------------------------------------------------------

    def _resolve(self, prompt: _Prompt, index: int) -> _Blocks:
        """Chunk ``index`` of ``prompt`` as blocks: vLLM's hashes over the whole prefix
        (every block of the prompt hashed at the first chunk that needs one)."""
        if prompt.keys is None:
            ids = np.frombuffer(prompt.tokens, dtype="<u4").tolist()
            digests = self.hasher.digests(ids, cache_salt=prompt.salt or None, memo=self._memo)
            prompt.keys = array("Q", map(block_key, digests))
        first = index * self._per_chunk
        cs4 = self.chunk_size * 4
        return _Blocks(
            prompt.keys[first : first + self._per_chunk],
            prompt.keys[first - 1] if index else None,
            None if prompt.salt else prompt.tokens[index * cs4 : (index + 1) * cs4],
        )

    def _emit_stored(self, out: list[EventOut], blocks: _Blocks, medium: str) -> None:
        """``BlockStored`` for ``blocks``, joined to the previous one when they continue it."""
        tokens = [] if blocks.tokens is None else np.frombuffer(blocks.tokens, "<u4").tolist()
        self._stored += len(blocks.keys)
        self._published += len(blocks.keys)
        last = out[-1] if out else None
        if (
            isinstance(last, StoredOut)
            and last.medium == medium
            and last.block_hashes[-1] == blocks.parent
            and bool(last.token_ids) == bool(tokens)
        ):
            last.block_hashes.extend(blocks.keys)
            last.token_ids.extend(tokens)
            return
        out.append(
            StoredOut(
                blocks.keys.tolist(),
                blocks.parent,
                tokens,
                self.hasher.block_size,
                None,
                medium,
                None,
            )
        )

    # -- what is known of chunks no tier holds ----------------------------------------------

    def _take_known(self, ck: _CKey) -> _Blocks | None:
        known = self._known.pop(ck, None)
        if known is None:
            return None
        blocks = known if isinstance(known, _Blocks) else self._resolve(*known)
        self._release(known)
        self._blocks[ck] = blocks
        return blocks

    def _keep(self, ck: _CKey, known: _Known) -> None:
        old = self._known.pop(ck, None)
        if old is not None:
            self._release(old)
        self._known[ck] = known
        if isinstance(known, _Blocks):
            self._kept += self.chunk_size
        else:
            prompt = known[0]
            prompt.live += 1
            if prompt.live == 1:
                self._kept += len(prompt.tokens) // 4

    def _release(self, known: _Known) -> None:
        if isinstance(known, _Blocks):
            self._kept -= self.chunk_size
            return
        prompt = known[0]
        prompt.live -= 1
        if prompt.live == 0:
            self._kept -= len(prompt.tokens) // 4

    def _trim(self) -> None:
        while self._kept > self._budget and self._known:
            _, known = self._known.popitem(last=False)
            self._release(known)
