"""Periodic observation of a running fleet, and the reading of its status documents.

Owns the sampler thread (every ``interval_s``: ``GET /instances`` for heartbeat ages,
``GET /directory/stats`` for placements per owner and the event gate's cursors, each live
server's ``/status`` for its publisher and P2P counters) and the readers of those typed
documents. The P2P counters are taken as every numeric field whose dotted path names
p2p, so the evaluation follows the servers' P2P counters as they grow.

Must not: change the fleet's state (read-only GETs only).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvatlas.evaluation.fleet import Fleet
from kvatlas.wire.coordinator_views import CursorView, StatsResponse
from kvatlas.wire.server_status import ServerStatus

log = logging.getLogger(__name__)


def flat_numbers(doc: Any, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON document, keyed by its dotted path."""
    out: dict[str, float] = {}
    if isinstance(doc, Mapping):
        for k, v in doc.items():
            out.update(flat_numbers(v, f"{prefix}{k}."))
    elif isinstance(doc, int | float) and not isinstance(doc, bool):
        out[prefix[:-1]] = float(doc)
    return out


def p2p_counters(status: ServerStatus | None) -> dict[str, float]:
    """The server's P2P numbers: every numeric field whose dotted path mentions p2p."""
    if status is None:
        return {}
    doc = msgspec.to_builtins(status)
    return {k: v for k, v in flat_numbers(doc).items() if "p2p" in k.lower()}


def stale_hint_fallbacks(counters: Mapping[str, float]) -> float:
    """Fallbacks because the directory named an owner that no longer had the chunk."""
    return sum(v for k, v in counters.items() if "stale" in k.lower() and "fallback" in k.lower())


def owner_placements(stats: StatsResponse | None) -> dict[tuple[str, int], int]:
    """(instance, incarnation) -> L1 placements the directory holds for it."""
    out: dict[tuple[str, int], int] = {}
    if stats is None:
        return out
    for o in stats.owners:
        if o.tier == "l1":
            key = (o.instance_id, o.incarnation)
            out[key] = out.get(key, 0) + o.placements
    return out


def cursors(stats: StatsResponse | None) -> dict[str, CursorView]:
    """instance -> the event gate's cursor (incarnation, last_seq, gaps, missing)."""
    if stats is None:
        return {}
    return {c.instance_id: c for c in stats.cursors}


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
                s.heartbeat_ages[i.instance_id] = i.heartbeat_age_s
            stats = f.directory_stats()
            for (iid, inc), n in owner_placements(stats).items():
                s.placements[f"{iid}@{inc}"] = n
        for k, srv in enumerate(f.servers):
            st = f.server_status(k)
            if st is None:
                continue
            s.server_chunks[srv.instance_id] = st.l1.chunks
            s.p2p[srv.instance_id] = p2p_counters(st)
            s.events[srv.instance_id] = {
                k2: float(v)
                for k2, v in msgspec.structs.asdict(st.events).items()
                if isinstance(v, int | float)
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
