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

Events the emitter itself dropped (LMCache 0.5.7's ``dropped_events``: cumulative per
incarnation, stamped on every batch) are a gap too, as LMCache's event gate counts them:
an applied batch whose count rose since the last applied batch of its incarnation counts
one gap and adds the rise to ``dropped``. The count is known from a stream's first batch
(seq 1) or a new incarnation (it starts at 0); a stream met midway, or restored from a
snapshot that did not hold it, only remembers its first report.
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
    dropped: int = 0
    """Events the instance reported dropping before they reached the coordinator, in
    total (the rises of its batches' ``dropped_events``)."""
    last_dropped: int | None = None
    """``dropped_events`` of the last applied batch of this incarnation; None: not known
    (a stream met midway, or a cursor restored from an older snapshot)."""


class Admission(msgspec.Struct, frozen=True):
    """The gate's outcome: verdict, the cursor to store if applied, what to fence first."""

    verdict: Verdict
    cursor: Cursor
    fence_incarnation: Incarnation | None = None
    """Incarnation whose L1 slice must be fenced before the batch applies."""
    gap: int = 0
    """Seqs missing right before this batch (0 when in order)."""
    dropped: int = 0
    """Events the sender reported dropping since its last applied batch (0: none)."""


def admit(
    cursor: Cursor | None,
    incarnation: Incarnation,
    seq: int,
    dropped_events: int | None = None,
) -> Admission:
    """Decide what to do with batch (``incarnation``, ``seq``) given the instance's cursor.

    ``dropped_events``: the batch's cumulative count of events its sender dropped (None:
    a batch that carries none, such as one of an unknown type; the count known stays).
    Pure: the caller stores ``admission.cursor`` only when it applies the batch.
    """
    if cursor is None:
        return _applied(Cursor(incarnation, 0), seq, dropped_events, 0 if seq == 1 else None)
    if incarnation < cursor.incarnation:
        return Admission(Verdict.STALE, cursor)
    if incarnation > cursor.incarnation:
        fresh = Cursor(incarnation, 0, cursor.gaps, cursor.missing, cursor.dropped)
        adm = _applied(fresh, seq, dropped_events, 0)
        return msgspec.structs.replace(adm, fence_incarnation=cursor.incarnation)
    if seq <= cursor.last_seq:
        return Admission(Verdict.DUPLICATE, cursor)
    return _applied(cursor, seq, dropped_events, cursor.last_dropped)


def _applied(cursor: Cursor, seq: int, dropped_events: int | None, known: int | None) -> Admission:
    """Apply (``seq``, ``dropped_events``) to ``cursor`` (last seq 0 for a new stream),
    whose sender's dropped count was ``known`` (None: unknown)."""
    gap = seq - cursor.last_seq - 1 if seq > cursor.last_seq + 1 else 0
    dropped = 0
    last = cursor.last_dropped  # a batch that carries no count leaves it as it was
    if dropped_events is not None:
        if known is not None and dropped_events > known:
            dropped = dropped_events - known
        last = dropped_events
    return Admission(
        Verdict.APPLY,
        Cursor(
            cursor.incarnation,
            seq,
            cursor.gaps + (1 if gap or dropped else 0),
            cursor.missing + gap,
            cursor.dropped + dropped,
            last,
        ),
        gap=gap,
        dropped=dropped,
    )
