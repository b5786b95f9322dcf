"""One vLLM engine's KV-event stream: the sequence state machine that keeps the device
tier exact across gaps, replays and restarts.

`EngineStream`: one engine's sequence numbers. A live batch one past the last applies;
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

Must not: open sockets, read clocks, decode msgpack or log; every step returns an
`Outcome` for the shell (`kvatlas.coordinator.vllm.ingest`) to apply, count and log.
"""

from __future__ import annotations

import msgspec

from kvatlas.core.device_blocks import DeviceEvent

DEFAULT_MAX_PENDING = 10_000
"""Live batches held while a replay fills the gap before them."""


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
