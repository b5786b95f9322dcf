"""The router's table of engines: who they are, whether to send them work, their load.

Owns, per engine URL: the cache instance it belongs to (its node's cache server, whose
holdings the coordinator reports), the model name that instance hashes under, health
(the last probe), a breaker (`core.breaker`: ``breaker_failures`` failures in a row open
it for ``breaker_open_s``; a successful probe or answer after that closes it), and the
router's own load accounting (requests in flight, their prefill tokens, plus the
requests the engine's last probe ran beyond the router's own: other clients' work), its
last sign of progress and first-byte deadline (``firstbyte``), and the rates its metrics
measure: its prefill (seconds per computed token) and the P2P reads its cache server
made for it (seconds per token read from peers). Engines come from the coordinator's
listing and from ``--engine``; one that leaves the listing is dropped once nothing is in
flight to it.

Single-threaded: the router's event loop owns it. Time is a parameter. Must not: do
I/O (the router's loops probe and list, and report here).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from kvatlas.core.breaker import Breaker, BreakerPolicy
from kvatlas.router.firstbyte import FirstByteWatch

RATE_SMOOTHING: Final = 0.3
"""Weight of the newest probe interval in a ``RateMeter`` (an exponential average)."""


@dataclass(slots=True)
class RateMeter:
    """Seconds per token from two cumulative counters (tokens, seconds) read at each
    probe: an exponential average over the intervals in which tokens were counted."""

    s_per_token: float | None = None
    """None until an interval counted tokens."""
    _tokens: float = field(default=-1.0, repr=False)
    _seconds: float = 0.0

    def sample(self, tokens: float, seconds: float) -> None:
        if self._tokens < 0 or tokens < self._tokens or seconds < self._seconds:
            # the first reading, or the counters restarted (a new engine process):
            # only the totals since its start are known
            d_tokens, d_seconds = tokens, seconds
        else:
            d_tokens, d_seconds = tokens - self._tokens, seconds - self._seconds
        self._tokens, self._seconds = tokens, seconds
        if d_tokens > 0 and d_seconds > 0:
            rate = d_seconds / d_tokens
            old = self.s_per_token
            self.s_per_token = rate if old is None else old + RATE_SMOOTHING * (rate - old)


@dataclass(slots=True)
class EngineState:
    """One engine, as the router knows it."""

    url: str
    instance_id: str
    model_name: str = ""
    static: bool = False
    listed: bool = True
    healthy: bool = False
    """Set by probes: an engine is not sent work before its first good probe."""
    breaker: Breaker = field(default_factory=Breaker)
    """Its breaker: failures in a row take it out for a cool-off (``EngineTable``'s
    policy)."""
    in_flight: int = 0
    queued_tokens: int = 0
    reported_running: int = 0
    """Requests running by the engine's last probe (its metrics)."""
    others_running: int = 0
    """Of those, the ones the router did not have in flight at the probe: other clients'.
    The router's own are counted live by ``in_flight``, so a probe taken while one of
    them ran does not keep the engine looking busy after it ends."""
    requests: int = 0
    errors: int = 0
    last_error: str = ""
    busy_s: float = 0.0
    """Seconds with at least one request in flight (for load balance reports)."""
    prefill: RateMeter = field(default_factory=RateMeter)
    """Its prefill: seconds per computed token (its metrics)."""
    p2p: RateMeter = field(default_factory=RateMeter)
    """Its cache server's P2P reads for it: seconds per token read from peers."""
    watch: FirstByteWatch = field(default_factory=FirstByteWatch)
    """Its last sign of progress and its learned first-byte deadline (``firstbyte``)."""
    _busy_since: float = field(default=0.0, repr=False)

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    @property
    def load(self) -> int:
        return self.in_flight + self.others_running

    def begin(self, prefill_tokens: int, now: float) -> None:
        self.watch.began(self.in_flight == 0, now)
        if self.in_flight == 0:
            self._busy_since = now
        self.in_flight += 1
        self.queued_tokens += prefill_tokens
        self.requests += 1

    def end(self, prefill_tokens: int, now: float) -> None:
        self.in_flight -= 1
        self.queued_tokens -= prefill_tokens
        if self.in_flight == 0:
            self.busy_s += now - self._busy_since

    def succeeded(self, now: float) -> None:
        self.breaker.record_success(now)

    def failed(self, reason: str, now: float, *, open_s: float | None = None) -> bool:
        """Count a failure; True when it opened the breaker (for ``open_s`` when given,
        else the policy's cool-off)."""
        self.errors += 1
        self.last_error = reason
        return self.breaker.record_failure(now, cooloff_s=open_s)

    def stalled(self, silent_s: float, deadline_s: float, now: float) -> None:
        """It showed no progress for ``silent_s`` while requests waited on it, past its
        first-byte deadline: its breaker opens for its cool-off, and its next deadline
        runs from now."""
        self.watch.trips += 1
        self.watch.last_progress = now
        self.breaker.trip(now)
        self.last_error = (
            f"no progress in {silent_s:.1f} s while requests waited on it (its first-byte"
            f" deadline: {deadline_s:.1f} s)"
        )

    def probed(self, ok: bool, running: int, reason: str, now: float) -> None:
        """A probe's outcome: a good one after the open period closes the breaker."""
        if ok:
            self.reported_running = running
            self.others_running = max(0, running - self.in_flight)
            if self.breaker.allows(now):
                self.breaker.record_success(now)
            self.healthy = True
        else:
            self.healthy = False
            self.last_error = reason


class EngineTable:
    """The engines known from the listing and the flags (see the module doc)."""

    def __init__(self, breaker: BreakerPolicy | None = None) -> None:
        self.engines: dict[str, EngineState] = {}
        self.breaker = breaker if breaker is not None else BreakerPolicy()
        """Every engine's breaker policy."""

    def add_static(self, url: str, instance_id: str) -> None:
        self.engines[url] = EngineState(
            url, instance_id, static=True, breaker=Breaker(self.breaker)
        )

    def update_listing(
        self, listing: Iterable[tuple[str, str, str]], models: dict[str, str]
    ) -> tuple[list[str], list[str]]:
        """Apply one coordinator listing: (engine URL, instance id, model name) for each
        advertised engine, and every live instance's model name (for ``--engine``
        engines). Returns the URLs added and dropped."""
        seen: set[str] = set()
        added: list[str] = []
        for url, instance_id, model in listing:
            seen.add(url)
            e = self.engines.get(url)
            if e is None:
                self.engines[url] = EngineState(
                    url, instance_id, model, breaker=Breaker(self.breaker)
                )
                added.append(url)
            else:
                e.instance_id, e.listed = instance_id, True
                e.model_name = model or e.model_name
        dropped: list[str] = []
        for url, e in list(self.engines.items()):
            if e.static:
                e.model_name = models.get(e.instance_id, e.model_name)
            elif url not in seen:
                e.listed = False
                if e.in_flight == 0:
                    del self.engines[url]
                    dropped.append(url)
        return added, dropped

    def available(self, now: float) -> list[EngineState]:
        """The engines that may be sent work now, in a stable order (their URLs)."""
        return sorted(
            (e for e in self.engines.values() if e.listed and e.available(now)),
            key=lambda e: e.url,
        )

    def p2p_s_per_token(self) -> float | None:
        """The fleet's P2P read cost, seconds per token: the mean over the engines that
        measured one (the links are the fleet's, whichever engine the read was for)."""
        rates = [r for e in self.engines.values() if (r := e.p2p.s_per_token) is not None]
        return sum(rates) / len(rates) if rates else None

    def p2p_weight(self, e: EngineState) -> float | None:
        """What reading one token from a peer costs ``e``, in its prefill tokens: the
        fleet's P2P seconds per token over ``e``'s prefill seconds per token (the mean of
        the fleet's when ``e`` has not measured its own); None until both are measured."""
        p2p = self.p2p_s_per_token()
        prefill = e.prefill.s_per_token
        if prefill is None:
            rates = [r for x in self.engines.values() if (r := x.prefill.s_per_token) is not None]
            prefill = sum(rates) / len(rates) if rates else None
        if p2p is None or prefill is None:
            return None
        return p2p / prefill

    def model_name(self) -> str:
        """The model name the known engines hash under (the first one declared)."""
        names = sorted({e.model_name for e in self.engines.values() if e.model_name})
        return names[0] if names else ""
