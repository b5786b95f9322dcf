"""A circuit breaker: whether to send work to one resource that has been failing.

The one breaker of kvatlas: a P2P peer (`core.peers.PeerHealth`), a coordinator
replica (`runtime.coordinator_replicas`), an engine of the router (`router.engines`)
and the router's coordinator (`router.lookups`) each keep one per resource, built from
a `BreakerPolicy`. Three states:

- closed: used. Failures in a row are counted; the ``threshold``-th opens it, and so
  does a ``hard`` failure (the resource is dead: asking it again costs a deadline).
- open: skipped for its cool-off (``cooloff_s``, times ``backoff`` for each failure in
  a row past the threshold, at most ``max_cooloff_s``). Failures of work sent before it
  opened are counted, and do not extend it (a hard one does: it opens again from now).
- half-open: the cool-off is over and no success has come since: work may be sent (a
  trial, or a probe). The count is not reset by opening, only by a success, so a
  breaker its failures opened opens again at the first failure after its cool-off; a
  success closes it.

`trip` opens it whatever the count (the resource stalled), `hold` keeps an open one
open another cool-off from now (its probe went unanswered), `close` closes it whatever
its state (it answered a call that was let through while it was open).

Pure: no I/O, no threads, no clock. Time is a parameter: every method that needs it
takes ``now`` from its caller's (injected) clock. Not thread-safe: its owner guards it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """When a breaker opens and for how long."""

    threshold: int = 1
    """Failures in a row that open it."""
    cooloff_s: float = 10.0
    """Seconds it stays open when its count has just reached ``threshold``."""
    backoff: float = 1.0
    """Each further failure in a row multiplies the cool-off by this (2.0 doubles it)."""
    max_cooloff_s: float = math.inf
    """The longest cool-off, however many failures came in a row."""

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"a breaker's threshold must be at least 1, got {self.threshold}")
        if self.cooloff_s < 0 or self.max_cooloff_s < 0:
            raise ValueError(
                f"a breaker's cool-off must not be negative, got {self.cooloff_s}"
                f" (at most {self.max_cooloff_s})"
            )
        if self.backoff < 1.0:
            raise ValueError(f"a breaker's backoff must be at least 1, got {self.backoff}")

    def cooloff(self, failures: int) -> float:
        """The cool-off after ``failures`` in a row."""
        extra = max(0, failures - self.threshold)
        if self.backoff == 1.0 or extra == 0:
            return min(self.cooloff_s, self.max_cooloff_s)
        try:
            grown = self.cooloff_s * self.backoff**extra
        except OverflowError:  # a long run of failures: far past any cap
            return self.max_cooloff_s
        return min(grown, self.max_cooloff_s)


class Breaker:
    """One resource's breaker (see the module doc)."""

    __slots__ = ("_open", "failures", "open_until", "opened", "policy")

    def __init__(self, policy: BreakerPolicy | None = None) -> None:
        self.policy = policy if policy is not None else BreakerPolicy()
        self.failures = 0
        """Failures since the last success."""
        self.opened = 0
        """Times it opened (a counter for status pages and metrics)."""
        self.open_until = 0.0
        """When its cool-off ends (0.0 while closed)."""
        self._open = False

    def state(self, now: float) -> BreakerState:
        if not self._open:
            return BreakerState.CLOSED
        return BreakerState.OPEN if now < self.open_until else BreakerState.HALF_OPEN

    def allows(self, now: float) -> bool:
        """Whether work may be sent now (closed or half-open)."""
        return not (self._open and now < self.open_until)

    def open_for(self, now: float) -> float:
        """Seconds of cool-off left; 0 when work may be sent."""
        return max(0.0, self.open_until - now) if self._open else 0.0

    def record_failure(
        self, now: float, *, hard: bool = False, cooloff_s: float | None = None
    ) -> bool:
        """Count a failure; True when it opened the breaker (``cooloff_s``, when given,
        instead of the policy's)."""
        self.failures += 1
        if not hard and (not self.allows(now) or self.failures < self.policy.threshold):
            return False
        self._start(now, cooloff_s)
        return True

    def record_success(self, now: float) -> None:
        """The resource did what was asked: the count restarts, and a half-open breaker
        closes. An open one stays open until its cool-off ends: the answer was to work
        sent before it opened."""
        self.failures = 0
        if self.allows(now):
            self._open = False
            self.open_until = 0.0

    def close(self) -> None:
        """Closed, whatever its state, with its count cleared."""
        self.failures = 0
        self._open = False
        self.open_until = 0.0

    def trip(self, now: float, *, cooloff_s: float | None = None) -> None:
        """Open it now whatever its count (the resource stalled); no failure counted."""
        self._start(now, cooloff_s)

    def hold(self, now: float) -> None:
        """An open or half-open breaker stays (or is again) open for at least the
        policy's cool-off from now; a closed one is left closed."""
        if self._open:
            self.open_until = max(self.open_until, now + self.policy.cooloff(self.failures))

    def _start(self, now: float, cooloff_s: float | None) -> None:
        cooloff = self.policy.cooloff(self.failures) if cooloff_s is None else cooloff_s
        self._open = True
        self.open_until = now + cooloff
        self.opened += 1
