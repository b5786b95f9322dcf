"""Periodic observation of a running fleet, and the reading of its status documents.

Owns the sampler thread (every ``interval_s``: ``GET /instances`` for heartbeat ages,
``GET /directory/stats`` for placements per owner and the event gate's cursors, each live
server's ``/status`` for its publisher and P2P counters) and the defensive readers of those
documents: a field that is missing or of another type reads as absent, never as an error,
so the evaluation follows the servers' status as it grows (P2P counters included).

Must not: change the fleet's state (read-only GETs only).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvatlas.evaluation.fleet import Fleet

log = logging.getLogger(__name__)


def num(doc: Any, *path: str) -> float | None:
    """``doc[path[0]][path[1]]...`` as a float, or None when absent or not a number."""
    cur = doc
    for key in path:
        if not isinstance(cur, Mapping) or key not in cur:
            return None
        cur = cur[key]
    if isinstance(cur, bool) or not isinstance(cur, int | float):
        return None
    return float(cur)


def integer(doc: Any, *path: str) -> int | None:
    """Like ``num`` but exact for integers (incarnations exceed a float's 53 bits)."""
    cur = doc
    for key in path:
        if not isinstance(cur, Mapping) or key not in cur:
            return None
        cur = cur[key]
    if isinstance(cur, bool) or not isinstance(cur, int):
        return None
    return cur


def flat_numbers(doc: Any, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON document, keyed by its dotted path."""
    out: dict[str, float] = {}
    if isinstance(doc, Mapping):
        for k, v in doc.items():
            out.update(flat_numbers(v, f"{prefix}{k}."))
    elif isinstance(doc, int | float) and not isinstance(doc, bool):
        out[prefix[:-1]] = float(doc)
    return out


def p2p_counters(status: Mapping[str, Any] | None) -> dict[str, float]:
    """The server's P2P numbers: every numeric field whose dotted path mentions p2p."""
    if not status:
        return {}
    return {k: v for k, v in flat_numbers(status).items() if "p2p" in k.lower()}


def stale_hint_fallbacks(counters: Mapping[str, float]) -> float:
    """Fallbacks because the directory named an owner that no longer had the chunk."""
    return sum(v for k, v in counters.items() if "stale" in k.lower() and "fallback" in k.lower())


def owner_placements(stats: Mapping[str, Any] | None) -> dict[tuple[str, int], int]:
    """(instance, incarnation) -> L1 placements the directory holds for it."""
    out: dict[tuple[str, int], int] = {}
    if not stats:
        return out
    for o in stats.get("owners") or []:
        if isinstance(o, Mapping) and o.get("tier") == "l1":
            key = (str(o.get("instance_id")), int(o.get("incarnation") or 0))
            out[key] = out.get(key, 0) + int(o.get("placements") or 0)
    return out


def cursors(stats: Mapping[str, Any] | None) -> dict[str, dict[str, int]]:
    """instance -> {incarnation, last_seq, gaps, missing} of the event gate."""
    out: dict[str, dict[str, int]] = {}
    if not stats:
        return out
    for c in stats.get("cursors") or []:
        if isinstance(c, Mapping):
            out[str(c.get("instance_id"))] = {
                k: int(c.get(k) or 0) for k in ("incarnation", "last_seq", "gaps", "missing")
            }
    return out


@dataclass(slots=True)
class Sample:
    """One observation of the whole fleet."""

    t: float
    coordinator_up: bool
    heartbeat_ages: dict[str, float] = field(default_factory=dict)
    placements: dict[str, int] = field(default_factory=dict)
    """``instance@incarnation`` -> L1 placements in the directory."""
    server_chunks: dict[str, int] = field(default_factory=dict)
    """instance -> L1 chunks the server itself reports."""
    p2p: dict[str, dict[str, float]] = field(default_factory=dict)
    events: dict[str, dict[str, float]] = field(default_factory=dict)


class Sampler:
    """A daemon thread that samples the fleet until ``stop``; bounded by ``max_samples``."""

    def __init__(
        self, fleet: Fleet, t0: float, interval_s: float = 0.5, max_samples: int = 10000
    ) -> None:
        self.fleet = fleet
        self.t0 = t0
        self.interval_s = interval_s
        self.max_samples = max_samples
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleet-sampler", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def sample(self) -> Sample:
        f = self.fleet
        s = Sample(time.monotonic() - self.t0, coordinator_up=False)
        inst = f.instances() if f.coordinator.alive() else None
        if inst is not None:
            s.coordinator_up = True
            for i in inst:
                age = num(i, "heartbeat_age_s")
                if age is not None:
                    s.heartbeat_ages[str(i.get("instance_id"))] = age
            stats = f.directory_stats()
            for (iid, inc), n in owner_placements(stats).items():
                s.placements[f"{iid}@{inc}"] = n
        for k, srv in enumerate(f.servers):
            st = f.server_status(k)
            if st is None:
                continue
            chunks = num(st, "l1", "chunks")
            if chunks is not None:
                s.server_chunks[srv.instance_id] = int(chunks)
            s.p2p[srv.instance_id] = p2p_counters(st)
            ev = st.get("events")
            if isinstance(ev, Mapping):
                s.events[srv.instance_id] = {
                    k2: float(v) for k2, v in ev.items() if isinstance(v, int | float)
                }
        return s

    def _loop(self) -> None:
        while not self._stop.is_set() and len(self.samples) < self.max_samples:
            try:
                s = self.sample()
            except Exception:  # a probe must never kill the run; the next sample retries
                log.debug("fleet sample failed", exc_info=True)
            else:
                with self._lock:
                    self.samples.append(s)
            self._stop.wait(self.interval_s)
