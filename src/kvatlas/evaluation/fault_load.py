"""The steady workload of the fault campaign, and what its lookups are held to.

Owns one engine per cache server (``NodeLoad``: a thread with its own `NodeDriver`
connected to that server only, sending the server its share of the request stream at a
steady rate, pausable while its server is the fault's victim, and taking a chosen request in between
when a fault needs one), the class of each lookup
as the server saw it (a local hit, a local miss, a lookup that asked a peer), the bound
each class is held to, and the per-second timeline of lookup latency.

A lookup asked a peer when its server's ``p2p_ms`` timings hold ``lock`` (a
``lookup_and_lock`` went out). Its bound is max(target, the server's own recompute
estimate of the chunks it did not have locally); every other lookup is bound by the
target alone. Must not: inject faults or start processes (``faults`` and ``fleet`` do).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Final, Literal

from kvatlas.evaluation.driver import NodeDriver, RequestRecord
from kvatlas.evaluation.fleet import Fleet
from kvatlas.evaluation.metrics import percentiles
from kvatlas.evaluation.workload import Request

LookupClass = Literal["local_hit", "local_miss", "p2p"]
CLASSES: Final[tuple[LookupClass, ...]] = ("local_hit", "local_miss", "p2p")


def lookup_class(rec: RequestRecord) -> LookupClass:
    """What the server did for this lookup."""
    if "lock" in rec.p2p_ms:
        return "p2p"
    if rec.full_chunks and rec.hit_chunks >= rec.full_chunks:
        return "local_hit"
    return "local_miss"


def bound_s(
    rec: RequestRecord, *, target_s: float, chunk_size: int, recompute_s_per_token: float
) -> float:
    """The longest this lookup may take: the target, or for a lookup that asked a peer,
    what recomputing the chunks it lacked locally would cost, if that is longer."""
    if lookup_class(rec) != "p2p":
        return target_s
    missing_tokens = (rec.full_chunks - rec.local_chunks) * chunk_size
    return max(target_s, missing_tokens * recompute_s_per_token)


class NodeLoad:
    """One engine on server ``k``: its requests in order, at ``rate_per_s``, repeating."""

    def __init__(
        self,
        fleet: Fleet,
        k: int,
        requests: Sequence[Request],
        *,
        rate_per_s: float,
        chunk_bytes: int,
        t0: float,
    ) -> None:
        if not requests:
            raise ValueError(f"no requests for node {k}")
        self.k = k
        self.requests = list(requests)
        self.rate_per_s = rate_per_s
        self.driver = NodeDriver(fleet, chunk_bytes=chunk_bytes, directory=False, t0=t0)
        self.records: list[RequestRecord] = []
        self._cv = threading.Condition()
        self._paused = False
        self._busy = False
        self._stop = threading.Event()
        self._extra: queue.SimpleQueue[tuple[Request, list[RequestRecord], threading.Event]]
        self._extra = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"load-{k}", daemon=True)

    def start(self) -> None:
        self.driver.connect(self.k)
        self._thread.start()

    def pause(self, timeout_s: float = 60.0) -> None:
        """Send no more requests; returns once the one in flight (if any) is done."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._paused = True
            while self._busy and time.monotonic() < deadline:
                self._cv.wait(0.05)

    def resume(self, *, reconnect: bool) -> None:
        """Send requests again (to a fresh connection when the server was restarted)."""
        if reconnect:
            self.driver.connect(self.k)
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def submit(self, req: Request, timeout_s: float = 30.0) -> RequestRecord | None:
        """Run ``req`` on this engine's thread before its next request of the stream (the
        engine must not be paused); its record, None if not done within ``timeout_s``."""
        out: list[RequestRecord] = []
        done = threading.Event()
        self._extra.put((req, out, done))
        done.wait(timeout_s)
        return out[0] if out else None

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._paused = False
            self._cv.notify_all()
        self._thread.join(60)
        self.driver.close()

    def snapshot(self) -> list[RequestRecord]:
        with self._cv:
            return list(self.records)

    def _loop(self) -> None:
        n = 0
        period = 1.0 / self.rate_per_s
        next_at = time.monotonic()
        while not self._stop.is_set():
            with self._cv:
                while self._paused and not self._stop.is_set():
                    self._cv.wait(0.1)
                    next_at = time.monotonic()
                if self._stop.is_set():
                    return
                self._busy = True
            try:
                extra = self._extra.get_nowait()
            except queue.Empty:
                extra = None
            try:
                req = extra[0] if extra else self.requests[n % len(self.requests)]
                rec = self.driver.run(req)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
            with self._cv:
                self.records.append(rec)
            if extra:
                extra[1].append(rec)
                extra[2].set()
                continue  # the stream's next request keeps its own pace
            n += 1
            # a steady rate: a slow request is not made up for by a burst after it
            next_at = max(next_at + period, time.monotonic())
            self._stop.wait(max(0.0, next_at - time.monotonic()))


def timeline(
    recs: Sequence[RequestRecord],
    *,
    t_from: float,
    t_to: float,
    target_s: float,
    chunk_size: int,
    recompute_s_per_token: float,
) -> dict[str, Any]:
    """Per second of [t_from, t_to): per lookup class, count and p50/p99/max in ms;
    requests failed, and lookups over their bound."""
    n = max(1, int(t_to - t_from + 0.999))
    buckets: list[list[RequestRecord]] = [[] for _ in range(n)]
    for r in recs:
        i = int(r.t - t_from)
        if 0 <= i < n:
            buckets[i].append(r)
    out: dict[str, Any] = {"t": [round(t_from + i, 3) for i in range(n)]}
    for cls in CLASSES:
        rows = [
            percentiles([r.lookup_s for r in b if not r.error and lookup_class(r) == cls], 1000.0)
            for b in buckets
        ]
        out[cls] = {
            "n": [row["n"] for row in rows],
            **{q: [row[q] if row["n"] else None for row in rows] for q in ("p50", "p99", "max")},
        }
    out["failed"] = [sum(1 for r in b if r.error) for b in buckets]

    def over(r: RequestRecord) -> bool:
        limit = bound_s(
            r, target_s=target_s, chunk_size=chunk_size, recompute_s_per_token=recompute_s_per_token
        )
        return not r.error and r.lookup_s > limit

    out["over_bound"] = [sum(1 for r in b if over(r)) for b in buckets]
    return out
