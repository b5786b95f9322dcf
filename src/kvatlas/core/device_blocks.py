"""The device tier: which vLLM engine's prefix cache holds which blocks (the per-engine
stream state machine that keeps it exact across gaps, replays and restarts is
`kvatlas.core.coordinator.engine_stream`).

Owns, pure and single-threaded (the ingest shell holds the lock):

* the device-block events as kvatlas types (`Stored`, `Removed`, `Cleared`), already
  decoded from vLLM's encodings by `kvatlas.wire.vllm_events`;
* `DeviceIndex`: per engine, the block keys its caches hold, with the media (GPU, CPU,
  disk) holding each one, and the longest leading run of a prompt's keys per engine;

A prefix counts only as far as vLLM would hit it (``find_longest_cache_hit`` of its
KV-cache coordinator): every full-attention group (and a group whose kind the events do
not name) must hold every block of it; a sliding-window group only the blocks of its
last window (``cdiv(sliding_window - 1, block_size)`` of them, ending where the prefix
ends), a Mamba group only the last block; the groups settle on one length, as vLLM's
fixed point does. Stores name the group's kind and window
(``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``). Not modelled: EAGLE's
dropped block, hash blocks finer than a group's block, chunked-local attention (taken
as full attention: it may undercount, never overcount).

Media are tiers, read in vLLM's order: the GPU prefix cache's leading run first, then
the blocks after it that the CPU offload tier holds (vLLM's offloading connector loads
from where the GPU hit ends), then the storage tier's (and unnamed media's). A block
held only on GPU after a CPU-only one does not count: vLLM recomputes it. `tiers`
gives each tier's blocks; for a hybrid model (a window group), the run is counted over
any medium and given to the first tier that holds all of it.

Blocks are named by vLLM's external block hashes as 64-bit ints (what removals and
parents name): vLLM publishes either the raw digest (bytes) or, with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, its low 64 bits (``int.from_bytes(digest,
"big") & (2**64 - 1)``); `block_key` maps both to the same int. Lookups go by content
keys instead (`kvatlas.core.coordinator.block_table`): a chain over the token ids a store carries,
its parent's content key and its extra keys (the cache salt), so a lookup by token ids
needs neither the engine's hash function nor its seed, and costs a few XXH3 calls per
block. A store without token ids (a CPU-offload tier's) takes the content key of a copy
already held (its GPU copy, in this engine or another); without one it is kept for
removals but never matched, and counted (`DeviceIndex.unchained`).

Must not: open sockets, read clocks, decode msgpack or log; every state change returns
an outcome for the shell to count and log.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NewType

import msgspec

from kvatlas.core.coordinator.block_table import BlockTable, BlockTableType, lora_seed
from kvatlas.core.errors import InvalidInput

BlockKey = NewType("BlockKey", int)
EngineId = NewType("EngineId", str)

_MASK64 = (1 << 64) - 1
MEDIA = ("GPU", "CPU", "STORAGE")
"""vLLM's media (``MEDIUM_GPU`` etc.); an unnamed medium is the GPU, as in vLLM."""
_OTHER_MEDIUM = len(MEDIA)
_GROUP_BITS = 4
_GROUP_MASK = (1 << _GROUP_BITS) - 1
_MAX_GROUP = 15
_WINDOWED = frozenset({"sliding_window", "sliding_window_mla"})
"""vLLM's ``KVCacheSpecKind`` values whose hits need only the last window's blocks."""
_LAST_BLOCK = frozenset({"mamba"})
"""Kinds whose hits need only the block where the prefix ends."""
_TIER_BITS = (0b0001, 0b0010, 0b1100)
"""The media bits of each tier, in the order vLLM reads them: GPU; CPU; storage and
media it does not name."""
_EVERY_GROUP = 0x1111_1111_1111_1111
"""Times a medium's bits: those bits in every group's nibble."""


def block_key(raw: int | bytes) -> BlockKey:
    """A published block hash (64-bit int or raw digest) as the index key."""
    if isinstance(raw, bool):
        raise InvalidInput("block hash is a boolean")
    if isinstance(raw, int):
        if raw < -(1 << 63) or raw > _MASK64:
            raise InvalidInput(f"block hash {raw} does not fit 64 bits")
        return BlockKey(raw & _MASK64)
    if isinstance(raw, bytes | bytearray | memoryview):
        if len(raw) == 0:
            raise InvalidInput("block hash is empty bytes")
        return BlockKey(int.from_bytes(raw, "big") & _MASK64)
    raise InvalidInput(f"block hash of type {type(raw).__name__}")


def medium_bit(medium: str | None, group: int = 0) -> int:
    """The bit of a medium in one KV-cache group; unknown media share one bit (still
    held, unnamed). Groups past the 16th share the last one."""
    if medium is None:
        index = 0
    else:
        try:
            index = MEDIA.index(medium.upper())
        except ValueError:
            index = _OTHER_MEDIUM
    return 1 << (index + _GROUP_BITS * min(group, _MAX_GROUP))


def fold_groups(mask: int) -> int:
    """A block's media over all of its groups (the low 4 bits' layout)."""
    out = 0
    while mask:
        out |= mask & _GROUP_MASK
        mask >>= _GROUP_BITS
    return out


def medium_names(mask: int) -> tuple[str, ...]:
    """The names of a (folded) media mask."""
    names = [m for i, m in enumerate(MEDIA) if mask >> i & 1]
    if mask >> _OTHER_MEDIUM & 1:
        names.append("OTHER")
    return tuple(names)


class Stored(msgspec.Struct, frozen=True):
    """``BlockStored``: blocks one group of one medium now holds. (A msgspec Struct,
    not a dataclass: the ingest makes one per event, and a frozen dataclass took
    4 us to build.)"""

    keys: tuple[BlockKey, ...]
    medium: str | None
    block_size: int
    with_tokens: bool
    """False for CPU-offload tiers that publish no token ids."""
    group: int = 0
    """The KV-cache group (hybrid models store one block hash in several groups: a
    removal from a sliding-window group leaves the full-attention group's copy)."""
    kind: str | None = None
    """The group's ``kv_cache_spec_kind`` (``full_attention``, ``sliding_window``,
    ``mamba``...); None when the publisher does not say (taken as full attention)."""
    window: int | None = None
    """The group's sliding window in tokens (``kv_cache_spec_sliding_window``)."""
    parent: BlockKey | None = None
    """The first block's parent (``parent_block_hash``); None: a prompt's first block."""
    tokens: bytes | Sequence[int] | None = None
    """The blocks' token ids, ``block_size`` per block, as uint32 little-endian bytes
    (the decoder's form) or ints (None: not published)."""
    lora_name: str | None = None
    extras: tuple[int, ...] | None = None
    """Per block, `kvatlas.core.coordinator.block_table.extra_hash` of its extra keys (the cache
    salt...), the LoRA name left out; None: none on any block."""


class Removed(msgspec.Struct, frozen=True):
    keys: tuple[BlockKey, ...]
    medium: str | None
    group: int = 0


class Cleared(msgspec.Struct, frozen=True):
    """``AllBlocksCleared``: the engine's caches were reset."""


DeviceEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class _Group:
    kind: str | None
    window: int | None
    block_size: int


@dataclass(slots=True)
class _Engine:
    table: BlockTableType = field(default_factory=BlockTable)
    block_size: int = 0
    groups: dict[int, _Group] = field(default_factory=dict)
    """The KV-cache groups its stores named, with their kind (the hit rule)."""
    unchained: int = 0
    """Blocks stored whose chain could not be followed (no token ids, or a parent no
    engine holds): held for removals, never matched by a lookup."""
    rule: tuple[list[int], dict[int, list[int]]] | None = None
    """The hit rule of its groups (`DeviceIndex._rule`), until a store names a group."""


def _nibble(group: int) -> int:
    return _GROUP_MASK << (_GROUP_BITS * min(group, _MAX_GROUP))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class DumpedBlock:
    """One block an engine holds, as Dynamo's ``/dump`` names it."""

    block_hash: int
    """The engine's own block hash (64-bit key)."""
    tokens_hash: int
    """Its local hash (Dynamo's ``LocalBlockHash``); 0 when unchained."""
    parent_hash: int | None
    media: tuple[str, ...]
    content: int
    """Its content key (0: unchained)."""


class DeviceIndex:
    """Per engine, a `BlockTable`: block hash -> content key and the mask of the
    (group, medium) pairs holding it. Lookups take content keys
    (`kvatlas.core.coordinator.block_table.prompt_keys`)."""

    def __init__(self) -> None:
        self._engines: dict[EngineId, _Engine] = {}
        self._seeds: dict[str | None, int] = {}
        self._bits: dict[tuple[str | None, int], int] = {}

    def _seed(self, lora_name: str | None) -> int:
        seed = self._seeds.get(lora_name)
        if seed is None:
            if len(self._seeds) > 4096:
                self._seeds.clear()
            seed = self._seeds[lora_name] = lora_seed(lora_name)
        return seed

    def _bit(self, medium: str | None, group: int) -> int:
        bit = self._bits.get((medium, group))
        if bit is None:
            if len(self._bits) > 4096:
                self._bits.clear()
            bit = self._bits[medium, group] = medium_bit(medium, group)
        return bit

    def _parent_content(self, e: _Engine, parent: BlockKey) -> int | None:
        """The content key of a store's parent: this engine's, else any engine's that
        holds the same hash (a CPU tier's store of a block whose GPU copy was evicted)."""
        found = e.table.content(parent)
        if found is not None:
            return found
        for other in self._engines.values():
            if other is not e:
                found = other.table.content(parent)
                if found is not None:
                    return found
        return None

    def apply(self, engine: EngineId, events: Iterable[DeviceEvent]) -> int:
        """Apply one batch's events in order; returns the number of blocks changed."""
        e = self._engines.get(engine)
        if e is None:
            e = self._engines[engine] = _Engine()
        changed = 0
        for ev in events:
            if isinstance(ev, Stored):
                bit = self._bit(ev.medium, ev.group)
                if ev.block_size > 0 and ev.block_size != e.block_size:
                    e.block_size = ev.block_size
                    e.rule = None
                known = e.groups.get(ev.group)
                if known is None or ev.kind is not None:
                    e.groups[ev.group] = _Group(ev.kind, ev.window, ev.block_size)
                    e.rule = None
                pc = None if ev.parent is None else self._parent_content(e, ev.parent)
                _, unchained = e.table.store(
                    ev.keys,
                    ev.parent,
                    pc,
                    ev.tokens,
                    ev.block_size,
                    self._seed(ev.lora_name),
                    ev.extras,
                    bit,
                )
                e.unchained += unchained
                changed += len(ev.keys)
            elif isinstance(ev, Removed):
                changed += e.table.remove(ev.keys, self._bit(ev.medium, ev.group))
            else:
                changed += e.table.clear()
        return changed

    def drop(self, engine: EngineId) -> int:
        """Forget an engine's blocks (a restart); returns how many there were."""
        e = self._engines.get(engine)
        if e is None:
            return 0
        n = e.table.clear()
        e.groups.clear()  # a restarted engine may serve another model
        e.rule = None
        return n

    def blocks(self, engine: EngineId) -> dict[BlockKey, int]:
        """One engine's blocks and their (group, medium) masks (tests, snapshots)."""
        e = self._engines.get(engine)
        if e is None:
            return {}
        return {BlockKey(k): mask for k, _c, mask, _l, _p in e.table.items()}

    def masks(self, engine: EngineId, keys: bytes) -> list[int]:
        """The (group, medium) mask of each content key's block (0: not held)."""
        e = self._engines.get(engine)
        return e.table.masks(keys) if e else [0] * (len(keys) // 8)

    def dump(self, engine: EngineId) -> list[DumpedBlock]:
        """One engine's blocks with their hashes and parents (Dynamo's ``/dump``)."""
        e = self._engines.get(engine)
        if e is None:
            return []
        return [
            DumpedBlock(k, local, parent, medium_names(fold_groups(mask)), content)
            for k, content, mask, local, parent in e.table.items()
        ]

    def count(self, engine: EngineId) -> int:
        """How many blocks the engine's caches hold."""
        e = self._engines.get(engine)
        return len(e.table) if e else 0

    def unchained(self, engine: EngineId) -> int:
        """Blocks stored without a chain (see `_Engine.unchained`), ever."""
        e = self._engines.get(engine)
        return e.unchained if e else 0

    def nbytes(self) -> int:
        """Bytes the compiled tables take (0 for the Python twin's)."""
        return sum(e.table.nbytes for e in self._engines.values())

    def block_size(self, engine: EngineId) -> int:
        """The block size the engine's last store named (0: none seen)."""
        e = self._engines.get(engine)
        return e.block_size if e else 0

    def engines(self) -> list[EngineId]:
        return sorted(self._engines)

    def total_blocks(self) -> int:
        return sum(len(e.table) for e in self._engines.values())

    def leading(self, engine: EngineId, keys: bytes) -> tuple[int, int]:
        """How many of the content ``keys`` (uint64 little-endian, `prompt_keys`) the
        engine would hit from the first one on, by vLLM's rule for its groups and its
        tiers (see the module docstring), and the media the hit is read from (0 when
        none)."""
        counts, media = self.tiers(engine, keys)
        return sum(counts), media

    def tiers(self, engine: EngineId, keys: bytes) -> tuple[tuple[int, int, int], int]:
        """Blocks of the hit read from each tier (GPU, CPU, storage), and their media."""
        e = self._engines.get(engine)
        if e is None or not len(e.table) or not keys:
            return (0, 0, 0), 0
        full, windows = e.rule or self._rule(e)
        if not windows:
            if not e.table.run(keys[:8], full)[0]:
                return (0, 0, 0), 0  # not even the first block, on any medium
            counts: list[int] = []
            done = media = 0
            for bits in _TIER_BITS:
                spread = bits * _EVERY_GROUP
                run, held = e.table.run(keys[done * 8 :], [nib & spread for nib in full])
                counts.append(run)
                done += run
                if run:
                    media |= held & bits
            return (counts[0], counts[1], counts[2]), media
        n, media = self._hybrid(e, keys, full, windows)
        tier = next((i for i, bits in enumerate(_TIER_BITS) if media & bits), 2)
        split = [0, 0, 0]
        split[tier] = n
        return (split[0], split[1], split[2]), media & _TIER_BITS[tier] if n else 0

    @staticmethod
    def _rule(e: _Engine) -> tuple[list[int], dict[int, list[int]]]:
        """The nibbles of the groups that must hold every block (full attention, or a
        kind the events do not name), and of those that need only the last blocks, by
        how many (sliding windows, Mamba)."""
        full: list[int] = []
        windows: dict[int, list[int]] = {}
        for g, spec in sorted(e.groups.items()) or [(0, _Group(None, None, 0))]:
            size = spec.block_size or e.block_size or 1
            if spec.kind in _WINDOWED and spec.window:
                windows.setdefault(_cdiv(spec.window - 1, size), []).append(_nibble(g))
            elif spec.kind in _LAST_BLOCK:
                windows.setdefault(1, []).append(_nibble(g))
            else:
                full.append(_nibble(g))
        e.rule = full, windows
        return e.rule

    def _hybrid(
        self, e: _Engine, keys: bytes, full: list[int], windows: dict[int, list[int]]
    ) -> tuple[int, int]:
        """The hit of a model with window groups, over any medium, and the media that
        hold all of its blocks."""
        held = e.table.masks(keys)
        n = len(held)
        if full:
            n = 0
            for m in held:
                if not all(m & nib for nib in full):
                    break
                n += 1
        while windows and n:
            shorter = n
            for need, nibs in windows.items():
                shorter = _window_hit(held, shorter, need, nibs)
            if shorter == n:
                break
            n = shorter
        media = -1
        for m in held[:n]:
            if m:  # a block only a window needed may be gone from every group
                media &= fold_groups(m)
        return n, media if n and media != -1 else 0


def _window_hit(held: list[int], n: int, need: int, nibs: list[int]) -> int:
    """vLLM's ``SlidingWindowManager.find_longest_cache_hit`` within the first ``n``
    keys: from the right, the first run of ``need`` blocks the groups all hold ends the
    hit; without one, the run from the first block on."""
    run = 0
    for i in range(n - 1, -1, -1):
        m = held[i]
        if all(m & nib for nib in nibs):
            run += 1
            if run >= need:
                return i + run
        else:
            run = 0
    return run
