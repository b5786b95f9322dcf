"""The event publisher: batches cache events per flush interval and sends them losslessly.

Owns seq assignment and the retry buffer. Producers (the chunk store's shell, a resync)
call ``publish`` from any thread; a flush thread wakes every flush interval, cuts what is
pending into batches — one batch per run of consecutive events of the same kind and tier,
at most ``max_batch_entries`` entries, so the order of STORE/DELETE of one key is kept —
gives each batch the next seq, appends it to a bounded buffer and sends the buffer, oldest
first, through the sink. A failed send leaves the batches in the buffer and they go again
at the next flush with the same seqs, so an outage shorter than the buffer loses nothing
and leaves no gap (the coordinator's gate drops what had arrived as duplicates). When the
buffer overflows, the oldest batches are dropped, counted and logged, and the first
successful send afterwards calls ``on_loss_recovered`` so that the owner can resync.
A batch sent for the first time that the coordinator answers as duplicate or stale is a
fault, not an echo of a resend: another sender spoke for this instance with a higher seq
or incarnation, and these events are lost at the coordinator. It is counted
(``rejected_batches``) and logged with instance, incarnation and seqs.

Must not: know the transport (that is the sink) or the coordinator's membership.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.server.errors import SinkError
from kvatlas.server.sinks import EventSink

log = logging.getLogger(__name__)

SHUTDOWN_S: Final = 1.0
"""At shutdown, the longest wait for a send in flight (a frozen coordinator held a
stopping server a whole send timeout, 5 s by default)."""

BACKEND_OF_TIER: dict[Tier, str] = {Tier.L1: "cpu", Tier.L2: "disk"}
MAX_BATCHES_PER_SEND = 64


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """A snapshot for /status and metrics."""

    pending_entries: int
    """Events published but not yet cut into a batch."""
    buffered_batches: int
    """Batches cut and not yet delivered (waiting for a retry)."""
    sent_batches: int
    sent_entries: int
    send_attempts: int
    failed_sends: int
    retried_batches: int
    """Batches sent again after a failed send."""
    dropped_batches: int
    """Batches dropped because the buffer overflowed."""
    dropped_entries: int
    rejected_batches: int
    """Batches sent for the first time that the coordinator answered as duplicate or
    stale (a fault: see the module docstring)."""
    last_seq: int
    last_error: str


class EventPublisher:
    """Thread-safe ``publish``; one flush thread owns seqs, the buffer and the sink."""

    def __init__(
        self,
        sink: EventSink,
        instance_id: InstanceId,
        incarnation: Incarnation,
        *,
        flush_interval_s: float = 1.0,
        buffer_batches: int = 4096,
        max_batch_entries: int = 512,
        on_loss_recovered: Callable[[], None] | None = None,
    ) -> None:
        self._sink = sink
        self._instance_id = instance_id
        self._incarnation = incarnation
        self._interval = flush_interval_s
        self._capacity = buffer_batches
        self._max_entries = max_batch_entries
        self._on_loss_recovered = on_loss_recovered
        self._lock = threading.Lock()
        self._pending: list[tuple[EventType, Tier, list[Entry]]] = []
        self._pending_entries = 0
        self._buffer: deque[EventBatch] = deque()
        self._unsent: set[int] = set()  # seqs whose last send failed (a resend is a retry)
        self._seq = 0
        self._sent_batches = 0
        self._sent_entries = 0
        self._attempts = 0
        self._failed = 0
        self._retried = 0
        self._dropped_batches = 0
        self._dropped_entries = 0
        self._rejected = 0
        self._lost_since_send = False
        self._last_error = ""
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ producers

    def publish(self, event_type: EventType, tier: Tier, entries: Iterable[Entry]) -> None:
        """Queue events for the next flush (order kept across calls)."""
        items = list(entries)
        if not items:
            return
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if last is not None and last[0] is event_type and last[1] is tier:
                last[2].extend(items)
            else:
                self._pending.append((event_type, tier, items))
            self._pending_entries += len(items)

    def flush_soon(self) -> None:
        """Wake the flush thread now instead of at the next interval."""
        self._wake.set()

    # ------------------------------------------------------------------ flushing

    def _cut(self) -> None:
        with self._lock:
            runs, self._pending, self._pending_entries = self._pending, [], 0
            now = time.time()
            for event_type, tier, items in runs:
                for start in range(0, len(items), self._max_entries):
                    self._seq += 1
                    self._buffer.append(
                        EventBatch(
                            instance_id=self._instance_id,
                            incarnation=self._incarnation,
                            seq=self._seq,
                            event_type=event_type,
                            tier=tier,
                            entries=tuple(items[start : start + self._max_entries]),
                            backend=BACKEND_OF_TIER[tier],
                            ts=now,
                        )
                    )
            overflow = len(self._buffer) - self._capacity
            if overflow > 0:
                dropped = [self._buffer.popleft() for _ in range(overflow)]
                n_entries = sum(b.n_entries for b in dropped)
                self._dropped_batches += overflow
                self._dropped_entries += n_entries
                self._lost_since_send = True
                for b in dropped:
                    self._unsent.discard(b.seq)
                log.warning(
                    "event buffer full: dropped %d batches (%d events, seqs %d..%d) of"
                    " instance %s incarnation %d; a resync follows the next successful send",
                    overflow,
                    n_entries,
                    dropped[0].seq,
                    dropped[-1].seq,
                    self._instance_id,
                    self._incarnation,
                )

    def flush(self) -> bool:
        """Cut pending events into batches and send the buffer; True when all was delivered.

        Called by the flush thread; callable directly (tests, shutdown).
        """
        with self._send_lock:
            self._cut()
            recovered = False
            while True:
                with self._lock:
                    chunk = list(self._buffer)[:MAX_BATCHES_PER_SEND]
                if not chunk:
                    break
                retried = sum(1 for b in chunk if b.seq in self._unsent)
                self._attempts += 1
                try:
                    refused = self._sink.send(chunk)
                except SinkError as exc:
                    with self._lock:
                        self._failed += 1
                        for b in chunk:
                            self._unsent.add(b.seq)
                        first_failure = self._last_error == ""
                        self._last_error = str(exc)
                    (log.warning if first_failure else log.debug)(
                        "event send of seqs %d..%d of instance %s incarnation %d failed"
                        " (%d batches buffered, retrying every %.1fs): %s",
                        chunk[0].seq,
                        chunk[-1].seq,
                        self._instance_id,
                        self._incarnation,
                        len(self._buffer),
                        self._interval,
                        exc,
                    )
                    return False
                with self._lock:
                    for _ in chunk:
                        self._buffer.popleft()
                    for b in chunk:
                        self._unsent.discard(b.seq)
                    self._sent_batches += len(chunk)
                    # A resent batch may have arrived before: its duplicate is expected.
                    rejected = refused - retried
                    if rejected > 0:
                        self._rejected += rejected
                        log.warning(
                            "coordinator answered %d batches of seqs %d..%d of instance %s"
                            " incarnation %d as duplicate or stale although %d of them were"
                            " sent for the first time: another sender is speaking for this"
                            " instance, and these events are lost at the coordinator",
                            refused,
                            chunk[0].seq,
                            chunk[-1].seq,
                            self._instance_id,
                            self._incarnation,
                            len(chunk) - retried,
                        )
                    self._sent_entries += sum(b.n_entries for b in chunk)
                    self._retried += retried
                    if self._last_error:
                        log.info(
                            "event sink %s reachable again at seq %d of instance %s incarnation %d",
                            self._sink.name,
                            chunk[-1].seq,
                            self._instance_id,
                            self._incarnation,
                        )
                    self._last_error = ""
                    if self._lost_since_send:
                        self._lost_since_send = False
                        recovered = True
            if recovered and self._on_loss_recovered is not None:
                self._on_loss_recovered()
            return True

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvatlas-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.flush()
            except Exception:  # keep publishing whatever one flush hit
                log.exception(
                    "event flush of instance %s incarnation %d failed unexpectedly",
                    self._instance_id,
                    self._incarnation,
                )

    def stop(self, final_flush: bool = True) -> None:
        """Stop the flush thread; by default try one last flush (one attempt). A send
        still in flight after ``SHUTDOWN_S`` (a frozen coordinator) is left to its daemon
        thread, and then no last flush is tried: it would wait a whole send timeout."""
        self._stop.set()
        self._wake.set()
        busy = False
        if self._thread is not None:
            self._thread.join(SHUTDOWN_S)
            busy = self._thread.is_alive()
            self._thread = None
        if busy:
            log.warning(
                "instance %s incarnation %d: an event send is still in flight at shutdown;"
                " no last flush (last seq %d)",
                self._instance_id,
                self._incarnation,
                self._seq,
            )
        elif final_flush:
            self.flush()
        self._sink.close()

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(
                pending_entries=self._pending_entries,
                buffered_batches=len(self._buffer),
                sent_batches=self._sent_batches,
                sent_entries=self._sent_entries,
                send_attempts=self._attempts,
                failed_sends=self._failed,
                retried_batches=self._retried,
                dropped_batches=self._dropped_batches,
                dropped_entries=self._dropped_entries,
                rejected_batches=self._rejected,
                last_seq=self._seq,
                last_error=self._last_error,
            )
