"""Peer bookkeeping for P2P: who the peers are, which ones to avoid, how long to wait.

Owns three pure decisions that the P2P controller (a shell with threads and sockets)
acts on:

- `PeerTable.reconcile(listing)`: from one successful `GET /instances` listing, which
  peer adapters to add, rebuild (endpoint changed) or remove (absent from 3 consecutive
  successful listings). An unreachable coordinator is not a listing, so it never costs
  a peer: peers keep serving each other through a coordinator outage.
- `PeerHealth`: a circuit breaker per peer (`core.breaker`). A hard failure (the peer
  is dead: refused, disconnected, a transport error, or it did not answer within its
  deadline) opens the breaker at once; softer ones (refusals, corrupt bytes) open it
  after ``threshold`` in a row. An open peer is skipped until it shows a new incarnation
  or reappears in a listing (the controller calls ``forget``), or answers a cheap probe:
  probes are due ``probe_after_s`` after opening, then at doubling intervals up to
  ``cooloff_s`` (half-open). A probe that goes unanswered keeps the breaker open another
  ``cooloff_s`` (``record_probe_failure``), so a frozen peer costs requests one deadline
  once, not one per cool-off; past ``cooloff_s`` without any probe (the poll thread was
  held up), one request may try it again.
- `p2p_deadline`: a lookup or load gives up at the configured timeout at the latest,
  and earlier when recomputing the missing tokens would be quicker than waiting.

No I/O, no clock: times are parameters.
"""

from __future__ import annotations

import enum

import msgspec

from kvatlas.core.breaker import Breaker, BreakerPolicy, BreakerState

MAX_MISSES = 3
"""Consecutive successful listings without a peer before its adapter is removed."""


class PeerEndpoint(msgspec.Struct, frozen=True):
    """How to reach a peer's transfer channel, as its registration advertises it."""

    instance_id: str
    url: str
    """``HOST:PORT`` of the peer's P2P channel (its ``p2p_advertised_url``)."""
    incarnation: int = 0
    metadata: dict[str, str] = {}


class ActionKind(enum.StrEnum):
    ADD = "add"
    REBUILD = "rebuild"
    REMOVE = "remove"


class PeerAction(msgspec.Struct, frozen=True):
    kind: ActionKind
    peer: PeerEndpoint


class PeerTable:
    """The live peers as seen through successive listings. Single-threaded."""

    def __init__(self, self_id: str, max_misses: int = MAX_MISSES) -> None:
        self.self_id = self_id
        self.max_misses = max_misses
        self._peers: dict[str, PeerEndpoint] = {}
        self._misses: dict[str, int] = {}

    def reconcile(self, listing: list[PeerEndpoint]) -> list[PeerAction]:
        """Apply one successful listing; returns the adapter changes to make, in order."""
        actions: list[PeerAction] = []
        seen: dict[str, PeerEndpoint] = {}
        for p in listing:
            if p.instance_id != self.self_id and p.url:
                seen[p.instance_id] = p
        for iid in sorted(seen):
            new = seen[iid]
            old = self._peers.get(iid)
            self._misses[iid] = 0
            if old is None:
                actions.append(PeerAction(ActionKind.ADD, new))
            elif (old.url, old.incarnation, old.metadata) != (
                new.url,
                new.incarnation,
                new.metadata,
            ):
                actions.append(PeerAction(ActionKind.REBUILD, new))
            self._peers[iid] = new
        for iid in sorted(set(self._peers) - set(seen)):
            self._misses[iid] = self._misses.get(iid, 0) + 1
            if self._misses[iid] >= self.max_misses:
                actions.append(PeerAction(ActionKind.REMOVE, self._peers.pop(iid)))
                del self._misses[iid]
        return actions

    def peers(self) -> list[PeerEndpoint]:
        return [self._peers[i] for i in sorted(self._peers)]

    def get(self, instance_id: str) -> PeerEndpoint | None:
        return self._peers.get(instance_id)

    def __len__(self) -> int:
        return len(self._peers)

    def misses(self) -> dict[str, int]:
        return {k: v for k, v in sorted(self._misses.items()) if v}


class PeerHealth:
    """One breaker per peer (`core.breaker`): closed (used), open (skipped; probed when
    due)."""

    def __init__(
        self, threshold: int = 3, cooloff_s: float = 10.0, probe_after_s: float = 0.25
    ) -> None:
        self.threshold = threshold
        self.cooloff_s = cooloff_s
        self.probe_after_s = min(probe_after_s, cooloff_s)
        self._policy = BreakerPolicy(threshold=threshold, cooloff_s=cooloff_s)
        self._breakers: dict[str, Breaker] = {}
        """Peers that failed since their last success or reappearance."""
        self._probe_at: dict[str, float] = {}
        self._probe_gap: dict[str, float] = {}
        self.opened = 0
        """Breakers opened since the start (a counter for /status and /metrics)."""

    def record_failure(self, peer: str, now: float, *, hard: bool = False) -> bool:
        """Count a failure; True when the breaker has just opened (at once when
        ``hard``: the peer is dead or frozen, asking it again costs a deadline)."""
        breaker = self._breakers.get(peer)
        if breaker is None:
            breaker = self._breakers[peer] = Breaker(self._policy)
        if breaker.state(now) is not BreakerState.CLOSED:
            return False
        if not breaker.record_failure(now, hard=hard):
            return False
        self._probe_at[peer] = now + self.probe_after_s
        self._probe_gap[peer] = self.probe_after_s
        self.opened += 1
        return True

    def record_probe_failure(self, peer: str, now: float) -> None:
        """A probe of an open peer went unanswered: requests keep skipping it for
        another ``cooloff_s`` (probes go on at their own, doubling, interval)."""
        breaker = self._breakers.get(peer)
        if breaker is not None:
            breaker.hold(now)

    def record_success(self, peer: str) -> None:
        """The peer answered (a request or a probe): close its breaker."""
        self.forget(peer)

    def available(self, peer: str, now: float) -> bool:
        breaker = self._breakers.get(peer)
        if breaker is None:
            return True
        state = breaker.state(now)
        if state is BreakerState.HALF_OPEN:  # no probe got through in cooloff_s: let one
            self.forget(peer)  # request try
        return state is not BreakerState.OPEN

    def due_probes(self, now: float) -> list[str]:
        """Open peers whose probe is due; each is not due again before its next,
        doubled, interval (at most ``cooloff_s``)."""
        due = sorted(p for p, t in self._probe_at.items() if t <= now)
        for p in due:
            gap = min(self.cooloff_s, self._probe_gap[p] * 2)
            self._probe_gap[p] = gap
            self._probe_at[p] = now + gap
        return due

    def cooling(self, now: float) -> list[str]:
        return sorted(p for p, b in self._breakers.items() if not b.allows(now))

    def forget(self, peer: str) -> None:
        """Close the breaker and clear the count (a new incarnation, a reappearance in
        the listing, an answered probe, or the peer's adapter removed)."""
        self._breakers.pop(peer, None)
        self._probe_at.pop(peer, None)
        self._probe_gap.pop(peer, None)


def p2p_deadline(
    configured_s: float,
    expected_recompute_s: float | None,
    factor: float = 1.0,
    floor_s: float = 0.05,
) -> float:
    """Seconds to wait for a peer: the configured timeout at most, and no longer than
    ``factor`` times the expected recompute time of the missing tokens (never below
    ``floor_s``, so a tiny recompute estimate does not rule P2P out)."""
    if expected_recompute_s is None or expected_recompute_s <= 0:
        return configured_s
    return min(configured_s, max(floor_s, factor * expected_recompute_s))
