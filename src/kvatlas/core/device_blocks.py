"""The device tier: which vLLM engine's prefix cache holds which blocks, and the
per-engine stream state machine that keeps it exact across gaps, replays and restarts.

Owns, pure and single-threaded (the ingest shell holds the lock):

* the device-block events as kvatlas types (`Stored`, `Removed`, `Cleared`), already
  decoded from vLLM's encodings by `kvatlas.wire.vllm_events`;
* `DeviceIndex`: per engine, the block keys its caches hold, with the media (GPU, CPU,
  disk) holding each one, and the longest leading run of a prompt's keys per engine;
* `EngineStream`: one engine's sequence numbers. A live batch one past the last applies;
  past that opens a gap (the shell asks the replay socket for the missing range, the
  batch waits); a live seq at or below the last live one means the publisher restarted
  (its `count()` starts again at 0; PUB/SUB never repeats one): that engine's blocks
  are dropped, then the new stream replays from 0. Batches at or below the last applied
  (a replay delivered them first, or delivers them again) are duplicates, skipped.
  Several replay requests can be on their way at once (a resync's, a reconnection's, a
  restart's): only the end marker of the last one sent ends the replay, so an earlier
  request's end does not release batches held for a later one before it delivered the
  seqs they wait on. An idle check asks from the last applied seq itself: a publisher
  that answers with nothing at or after it has restarted with fewer batches (the
  restart a subscriber that missed the new publisher's first batches cannot otherwise
  see). A gap asks from the last applied seq too, for the same check: a restarted
  publisher that has already passed it answers with another batch at that seq. A
  restart found inside a replay that did not start at 0 asks for everything again, and
  holds what comes until the new stream's seq 0 (or the replay's end).

Each batch's `Skipped` tally (what its decoding skipped) comes back in the outcome that
applies it, so a batch delivered again (a replay, an idle check) is counted once.

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
keys instead (`kvatlas.core.block_table`): a chain over the token ids a store carries,
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

from kvatlas.core.block_table import BlockTable, BlockTableType, lora_seed
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
DEFAULT_MAX_PENDING = 10_000
"""Live batches held while a replay fills the gap before them."""


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
    """Per block, `kvatlas.core.block_table.extra_hash` of its extra keys (the cache
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
    (`kvatlas.core.block_table.prompt_keys`)."""

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


class Skipped(msgspec.Struct, frozen=True):
    """What decoding one batch skipped: counted when the batch applies, once."""

    malformed_events: int = 0
    unknown_types: int = 0
    unknown_fields: int = 0

    def __add__(self, other: Skipped) -> Skipped:
        return Skipped(
            self.malformed_events + other.malformed_events,
            self.unknown_types + other.unknown_types,
            self.unknown_fields + other.unknown_fields,
        )


NOTHING_SKIPPED = Skipped()


class Outcome(msgspec.Struct, frozen=True):
    """What one step of an engine's stream asks of the shell."""

    apply: tuple[tuple[int, tuple[DeviceEvent, ...]], ...] = ()
    """Batches (seq, events) to apply to the index, in order."""
    replay_from: int | None = None
    """Ask the replay socket for every batch from this seq on."""
    restarted: bool = False
    """The publisher restarted: drop the engine's blocks before applying."""
    duplicate: bool = False
    lost: int = 0
    """Seqs that neither the stream nor the replay delivered (replay buffer too short)."""
    overflow: int = 0
    """Live batches dropped because too many waited for a replay."""
    skipped: Skipped = NOTHING_SKIPPED
    """What the decoding of the batches in ``apply`` skipped."""


class EngineStream:
    """The seq state machine of one engine's publisher (see the module docstring).

    Each applied batch's fingerprint (a hash of its payload) is kept for the last
    ``max_prints`` seqs: a batch at a seq already applied whose fingerprint differs
    comes from a new publisher (a restart seen through a replay, when no live batch of
    the new one revealed it first)."""

    def __init__(
        self, max_pending: int = DEFAULT_MAX_PENDING, max_prints: int = 2 * DEFAULT_MAX_PENDING
    ) -> None:
        self.last: int | None = None
        """The last seq applied; None before the first."""
        self.live_last: int | None = None
        """The last seq seen on the PUB socket (it only goes back on a restart)."""
        self.replaying = False
        self._awaiting = 0
        """Replay requests sent (`replay_sent`) whose end marker has not come."""
        self._verify: int | None = None
        """The seq an idle check asked to see again (`connect`); None once seen."""
        self._from_zero = False
        """A restart was found inside a replay that did not start at 0: replayed batches
        wait (in ``_pending``) until the new stream's seq 0 comes."""
        self._pending: dict[int, tuple[tuple[DeviceEvent, ...], int, Skipped]] = {}
        self._prints: dict[int, int] = {}
        self._max_pending = max_pending
        self._max_prints = max_prints

    def connect(self) -> Outcome:
        """Ask for what the publisher buffers from the last applied seq on (an idle
        engine's check that nothing was missed): the last one comes back as a check of
        its fingerprint, and a publisher with nothing at or after it has restarted."""
        self.replaying = True
        self._verify = self.last
        return Outcome(replay_from=0 if self.last is None else self.last)

    def reconnected(self) -> Outcome:
        """The subscriber (re)connected: ask for everything the publisher buffers, which
        also reveals a restarted publisher by its fingerprints."""
        self.replaying = True
        return Outcome(replay_from=0)

    def live(
        self,
        seq: int,
        events: tuple[DeviceEvent, ...],
        fingerprint: int = 0,
        skipped: Skipped = NOTHING_SKIPPED,
    ) -> Outcome:
        """A batch from the PUB socket."""
        if (self.live_last is not None and seq <= self.live_last) or self._differs(
            seq, fingerprint
        ):
            # PUB/SUB neither repeats nor reorders: the publisher's counter started again.
            self.live_last = seq
            self._reset()
            self._pending[seq] = (events, fingerprint, skipped)
            self.replaying = True
            return Outcome(restarted=True, replay_from=0)
        self.live_last = seq
        if self.last is not None and seq <= self.last:
            return Outcome(duplicate=True)  # a replay delivered it first
        if self.replaying:
            return self._hold(seq, events, fingerprint, skipped)
        if (self.last is None and seq == 0) or (self.last is not None and seq == self.last + 1):
            self._applied(seq, fingerprint)
            return Outcome(apply=((seq, events),), skipped=skipped)
        out = self._hold(seq, events, fingerprint, skipped)
        self.replaying = True
        # From the last applied seq itself, not the one after: a publisher that restarted
        # and passed it answers there with another batch (a restart no live seq showed).
        self._verify = self.last
        return Outcome(replay_from=0 if self.last is None else self.last, overflow=out.overflow)

    def replayed(
        self,
        seq: int,
        events: tuple[DeviceEvent, ...],
        fingerprint: int = 0,
        skipped: Skipped = NOTHING_SKIPPED,
    ) -> Outcome:
        """A batch from the replay socket."""
        restarted = False
        if self._differs(seq, fingerprint):
            self._reset()
            restarted = True
            if seq > 0:
                # The new publisher's batches before this one: ask for all of them, and
                # hold what comes until its seq 0 (this answer goes on from here).
                self._from_zero = True
                self.replaying = True
                self._pending[seq] = (events, fingerprint, skipped)
                return Outcome(restarted=True, replay_from=0)
        held = self._pending.pop(seq, None)
        if held is not None and held[1] != fingerprint:
            held = None
        if self._verify is not None and seq >= self._verify:
            checked = seq == self._verify
            self._verify = None
            if checked:
                return Outcome()  # the check's own seq: seen again, unchanged
        if self.last is not None and seq <= self.last:
            return Outcome(duplicate=True)
        if self._from_zero:
            if seq > 0:
                return self._hold(seq, events, fingerprint, skipped)
            self._from_zero = False
        lost = 0
        if self.last is not None and seq > self.last + 1:
            lost = seq - self.last - 1
        self._applied(seq, fingerprint)
        return Outcome(apply=((seq, events),), lost=lost, restarted=restarted, skipped=skipped)

    def replay_sent(self) -> None:
        """The shell's replay request went out (its end marker will come)."""
        self._awaiting += 1

    def replay_end(self) -> Outcome:
        """A replay's end marker. An earlier request's end (a later one is still on its
        way) or one no request awaits (the shell gave up on it) changes nothing; the
        last request's end ends the replay (`replay_done`), or reveals a restart when
        an idle check's seq did not come back."""
        if self._awaiting == 0:
            return Outcome()
        self._awaiting -= 1
        if self._awaiting:
            return Outcome()
        if self._verify is not None:
            # Nothing at or after the last applied seq: a new publisher, behind it.
            self._reset()
            return Outcome(restarted=True, replay_from=0)
        return self.replay_done()

    def replay_done(self) -> Outcome:
        """The replay ended (the last request's end marker, or the shell gave up
        waiting): apply what waited, in order; a hole left between them is lost."""
        self.replaying = False
        self._awaiting = 0
        self._verify = None
        self._from_zero = False
        out: list[tuple[int, tuple[DeviceEvent, ...]]] = []
        lost = 0
        skipped = NOTHING_SKIPPED
        for seq in sorted(self._pending):
            if self.last is not None and seq <= self.last:
                continue
            if self.last is not None and seq > self.last + 1:
                lost += seq - self.last - 1
            events, fingerprint, tally = self._pending[seq]
            self._applied(seq, fingerprint)
            out.append((seq, events))
            skipped += tally
        self._pending.clear()
        return Outcome(apply=tuple(out), lost=lost, skipped=skipped)

    def _differs(self, seq: int, fingerprint: int) -> bool:
        known = self._prints.get(seq)
        return known is not None and known != fingerprint

    def _reset(self) -> None:
        self.last = None
        self.live_last = None
        self._verify = None
        self._from_zero = False
        self._pending.clear()
        self._prints.clear()

    def _applied(self, seq: int, fingerprint: int) -> None:
        self.last = seq
        self._prints[seq] = fingerprint
        if len(self._prints) > self._max_prints:
            del self._prints[next(iter(self._prints))]

    def _hold(
        self, seq: int, events: tuple[DeviceEvent, ...], fingerprint: int, skipped: Skipped
    ) -> Outcome:
        overflow = 0
        if len(self._pending) >= self._max_pending:
            self._pending.pop(min(self._pending))
            overflow = 1
        self._pending[seq] = (events, fingerprint, skipped)
        return Outcome(overflow=overflow)
