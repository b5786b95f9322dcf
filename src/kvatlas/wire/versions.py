"""The version rule every kvatlas wire follows, and the choice of a common version.

Each wire names its range in its own module, once: ``P2P_VERSIONS``
(`wire.p2p_proto`), ``ENGINE_VERSIONS`` (`wire.engine_proto`), ``COMPACT_VERSIONS``
(`wire.events_api`), ``RECORD_VERSIONS`` (`wire.kafka_records`) and the tcp data
plane's ``TCP_VERSIONS`` (`transfer.tcp`). A range is ``MIN..CURRENT`` with ``MIN =
CURRENT - 1`` once ``CURRENT > 1``: a node of version N talks to one of N-1 in both
directions, so a fleet is upgraded one node at a time.

Request/response wires (P2P control, engine API) negotiate: a request carries its
version; a server answers it in that version when it supports it, else with a
``version`` error carrying the range it supports (``min_v``, ``max_v``), and the client
moves once to the highest version both support (`highest_common`) and keeps it for that
peer. A server of the first release answers with ``version`` and no range: it speaks 1
only (`peer_range`). One-way wires (event bodies, Kafka records) cannot ask: a writer
marks what it writes, and a reader skips and counts what it cannot read.

Owns the rule only; no I/O and no state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VersionRange:
    """The versions one side of a wire reads and answers in: ``lo`` to ``hi``."""

    lo: int
    hi: int

    @classmethod
    def upto(cls, current: int) -> VersionRange:
        """The house rule: ``current`` and the one before it (1 alone for 1)."""
        return cls(max(1, current - 1), current)

    def supports(self, v: int) -> bool:
        return self.lo <= v <= self.hi

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}..{self.hi}"


FIRST_RELEASE = VersionRange(1, 1)
"""What a peer that refuses a version without naming its range speaks: the first
release's servers answered any version but 1 with a bare ``version`` error."""


def peer_range(min_v: int, max_v: int) -> VersionRange:
    """The range a ``version`` error names; `FIRST_RELEASE` when it names none."""
    if max_v <= 0:
        return FIRST_RELEASE
    return VersionRange(max(1, min_v), max_v)


def highest_common(mine: VersionRange, theirs: VersionRange) -> int | None:
    """The highest version both sides speak, None when the ranges do not meet."""
    v = min(mine.hi, theirs.hi)
    return v if v >= max(mine.lo, theirs.lo) else None
