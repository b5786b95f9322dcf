"""How long to wait for a peer, learned from how fast it has answered.

A P2P fetch makes two different requests of a peer, and each gets a deadline of its own:

- the lock RPC (``lookup_and_lock``: a few hundred bytes each way) waits
  ``max(floor, p99_factor x the peer's RPC p99)``. A healthy peer answers in a few milliseconds,
  so a frozen one costs this short deadline once (the controller then opens its breaker for
  every lookup), instead of the whole recompute time of the prefix;
- the load (the KV bytes) waits ``max(LOAD_FLOOR_S, load_factor x bytes / the peer's
  bandwidth)``: it scales with the bytes, so a merely slow but answering peer is still
  read from.

Both are capped by what the caller passes: ``core.peers.p2p_deadline`` of the configured
timeout and the time recomputing the missing tokens would take.

Before a peer answered anything its lock deadline is a prior: ``max(floor, p99_factor x
the p99 of every peer's RPCs)`` once any peer answered, else ``prior_s``
(``--p2p-lock-deadline-prior-s``). Before its bandwidth is known a load waits the cap.

Owns the samples: per peer, the last ``RPC_SAMPLES`` RPC round trips (a bounded ring,
so a p99 follows the peer's recent state and costs a sort of at most that many floats)
and an EWMA of its load bandwidth; fleet-wide, the last ``RPC_SAMPLES`` round trips of
any peer. Pure: no clock, no I/O, single-threaded; the shells measure durations with
their clock and pass them in, and lock around it. Must not: decide whether a peer is
down (``core.peers.PeerHealth`` does, from the failures these deadlines produce).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final

RPC_SAMPLES: Final = 128
"""Round trips kept per peer (and fleet-wide) for the p99."""
BANDWIDTH_ALPHA: Final = 0.3
"""Weight of the newest load in the bandwidth EWMA."""
LOAD_FLOOR_S: Final = 0.25
"""The least a load waits once the peer's bandwidth is known. Generous on purpose: the
peer answered its lock RPC a moment before, so a load that overruns is far more often a
scheduler hiccup or a GC pause of a busy machine than a peer that froze in between, and
a false timeout costs a recompute (and the peer's breaker opening)."""


@dataclass(frozen=True, slots=True)
class DeadlinePolicy:
    """The knobs of the two deadlines (``P2PConfig`` fills it from flags)."""

    lock_floor_s: float = 0.025
    """The least a lock RPC waits (``--p2p-lock-deadline-floor-s``)."""
    lock_p99_factor: float = 4.0
    """Lock deadline = this x the peer's RPC p99, at least the floor
    (``--p2p-lock-deadline-factor``)."""
    lock_prior_s: float = 0.1
    """Lock deadline before any peer answered (``--p2p-lock-deadline-prior-s``). Why 0.1 s:
    a healthy peer answers in a few milliseconds, but the first request to it also opens
    the connection (TCP and the ZeroMQ handshake), which on a busy machine can take tens
    of ms; 0.1 s leaves that ample room, and a frozen peer met first
    still costs, with the directory's 75 ms, less than 250 ms once."""
    load_factor: float = 4.0
    """Load deadline = this x bytes / the peer's bandwidth (``--p2p-load-deadline-factor``)."""


@dataclass(frozen=True, slots=True)
class PeerTimingView:
    """What is known of one peer, for /status and /metrics."""

    peer: str
    rpc_samples: int
    rpc_p99_s: float | None
    bandwidth_bps: float | None
    lock_deadline_s: float
    """The lock deadline it gets now (before the recompute cap of a lookup)."""
    last_lock_deadline_s: float | None
    last_load_deadline_s: float | None


def _p99(samples: deque[float]) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class PeerTimings:
    """Per-peer RPC latencies and load bandwidths, and the deadlines they give."""

    def __init__(self, policy: DeadlinePolicy | None = None) -> None:
        self.policy = policy or DeadlinePolicy()
        self._rpc: dict[str, deque[float]] = {}
        self._fleet: deque[float] = deque(maxlen=RPC_SAMPLES)
        self._bandwidth: dict[str, float] = {}
        self._last_lock: dict[str, float] = {}
        self._last_load: dict[str, float] = {}

    # ------------------------------------------------------------------ samples

    def observe_rpc(self, peer: str, seconds: float) -> None:
        """A control request to ``peer`` answered after ``seconds``."""
        if not seconds >= 0 or math.isinf(seconds):
            return
        ring = self._rpc.get(peer)
        if ring is None:
            ring = self._rpc[peer] = deque(maxlen=RPC_SAMPLES)
        ring.append(seconds)
        self._fleet.append(seconds)

    def observe_load(self, peer: str, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` from ``peer`` landed after ``seconds``."""
        if nbytes <= 0 or not seconds > 0 or math.isinf(seconds):
            return
        rate = nbytes / seconds
        prev = self._bandwidth.get(peer)
        self._bandwidth[peer] = rate if prev is None else prev + BANDWIDTH_ALPHA * (rate - prev)

    def load_timed_out(self, peer: str) -> None:
        """A load from ``peer`` missed its deadline: its bandwidth is no longer known, so
        the next load (once its breaker closes) waits the recompute cap again and the
        estimate starts afresh from what it then takes."""
        self._bandwidth.pop(peer, None)

    def forget(self, peer: str) -> None:
        """The peer is gone or is a new process (a new incarnation or endpoint)."""
        self._rpc.pop(peer, None)
        self._bandwidth.pop(peer, None)
        self._last_lock.pop(peer, None)
        self._last_load.pop(peer, None)

    # ------------------------------------------------------------------ deadlines

    def _lock_learned(self, peer: str) -> float:
        p = self.policy
        p99 = _p99(self._rpc.get(peer, deque()))
        if p99 is None:
            fleet = _p99(self._fleet)
            if fleet is None:
                return max(p.lock_floor_s, p.lock_prior_s)
            p99 = fleet
        return max(p.lock_floor_s, p.lock_p99_factor * p99)

    def lock_deadline(self, peer: str, cap_s: float) -> float:
        """Seconds to wait for ``peer``'s answer to a lock RPC, at most ``cap_s`` (the
        recompute cap, or what is left of the lookup's time)."""
        d = min(cap_s, self._lock_learned(peer))
        self._last_lock[peer] = d
        return d

    def load_deadline(self, peer: str, nbytes: int, cap_s: float) -> float:
        """Seconds to wait for ``nbytes`` from ``peer``, at most ``cap_s``."""
        bw = self._bandwidth.get(peer)
        d = cap_s
        if bw is not None and bw > 0:
            d = min(cap_s, max(LOAD_FLOOR_S, self.policy.load_factor * nbytes / bw))
        self._last_load[peer] = d
        return d

    # ------------------------------------------------------------------ views

    def views(self, peers: list[str]) -> list[PeerTimingView]:
        out: list[PeerTimingView] = []
        for peer in peers:
            ring = self._rpc.get(peer, deque())
            out.append(
                PeerTimingView(
                    peer=peer,
                    rpc_samples=len(ring),
                    rpc_p99_s=_p99(ring),
                    bandwidth_bps=self._bandwidth.get(peer),
                    lock_deadline_s=self._lock_learned(peer),
                    last_lock_deadline_s=self._last_lock.get(peer),
                    last_load_deadline_s=self._last_load.get(peer),
                )
            )
        return out

    def fleet_rpc_p99(self) -> float | None:
        return _p99(self._fleet)
