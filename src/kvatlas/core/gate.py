"""The event gate: a pure function deciding what to do with a batch from one emitter.

Every consumer (HTTP ingest, Kafka ingest, snapshot replay) passes each batch through
`admit` before the directory sees it. The rules, for the cursor of the batch's instance:

- no cursor yet            -> apply (seq > 1 counts as a gap: earlier batches were missed)
- lower incarnation        -> stale, dropped
- higher incarnation       -> fence the old incarnation's L1 slice first, then apply
- seq <= last seq          -> duplicate, dropped
- seq == last seq + 1      -> apply
- seq >  last seq + 1      -> apply, and count a gap of the missing seqs

A batch that arrives after a later seq of the same incarnation was applied is treated as
a duplicate: applying it would let an old STORE resurrect a newer DELETE. The gap it
left is visible in the cursor (``gaps``, ``missing``) until the emitter resyncs.
"""

from __future__ import annotations

import enum

import msgspec

from kvatlas.core.types import Incarnation


class Verdict(enum.StrEnum):
    """What the gate decided for a batch."""

    APPLY = "apply"
    DUPLICATE = "duplicate"
    STALE = "stale"


class Cursor(msgspec.Struct, frozen=True):
    """What the gate remembers of one instance: its incarnation and last applied seq."""

    incarnation: Incarnation
    last_seq: int
    gaps: int = 0
    """Number of gaps seen in this instance's stream (across incarnations)."""
    missing: int = 0
    """Number of seqs skipped in total."""


class Admission(msgspec.Struct, frozen=True):
    """The gate's outcome: verdict, the cursor to store if applied, what to fence first."""

    verdict: Verdict
    cursor: Cursor
    fence_incarnation: Incarnation | None = None
    """Incarnation whose L1 slice must be fenced before the batch applies."""
    gap: int = 0
    """Seqs missing right before this batch (0 when in order)."""


def admit(cursor: Cursor | None, incarnation: Incarnation, seq: int) -> Admission:
    """Decide what to do with batch (``incarnation``, ``seq``) given the instance's cursor.

    Pure: the caller stores ``admission.cursor`` only when it applies the batch.
    """
    if cursor is None:
        gap = seq - 1 if seq > 1 else 0
        return Admission(
            Verdict.APPLY,
            Cursor(incarnation, seq, 1 if gap else 0, gap),
            gap=gap,
        )
    if incarnation < cursor.incarnation:
        return Admission(Verdict.STALE, cursor)
    if incarnation > cursor.incarnation:
        gap = seq - 1 if seq > 1 else 0
        return Admission(
            Verdict.APPLY,
            Cursor(incarnation, seq, cursor.gaps + (1 if gap else 0), cursor.missing + gap),
            fence_incarnation=cursor.incarnation,
            gap=gap,
        )
    if seq <= cursor.last_seq:
        return Admission(Verdict.DUPLICATE, cursor)
    gap = seq - cursor.last_seq - 1
    return Admission(
        Verdict.APPLY,
        Cursor(incarnation, seq, cursor.gaps + (1 if gap else 0), cursor.missing + gap),
        gap=gap,
    )
