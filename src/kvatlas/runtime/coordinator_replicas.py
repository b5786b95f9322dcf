"""The coordinator's replicas as its clients see them, and what a call to them raises.

Owns the error tree of a coordinator call (kvatlas' ``ServiceError`` branch, raised
``from`` the transport's error):

    ServiceError (core)
     +-- CoordinatorError           the coordinator did not do what was asked
          +-- CoordinatorUnreachable    no answer: refused connection, timeout, reset
          +-- CoordinatorRefused        an answer other than 2xx: ``status``, ``reason``
          |    +-- UnknownInstance      404 to a heartbeat: register again
          +-- BadAnswer                 a 2xx whose body is not the expected shape

``CoordinatorError.status`` is the HTTP status, 0 when there was no answer.

And the failover rule, shared by the blocking client (`coordinator_client`) and the
event loop's lookups (`coordinator_lookups`): `Replicas` is the ordered list of
coordinator URLs (one is the common case, and then every call goes there) with a
breaker each (`core.breaker`). A call sticks to the replica that last answered; one
that gets no answer (refused, reset, timed out) or a 5xx from it goes on to the next
replica in the list, within the call's own deadline (`ReplicaWalk`), and the failed
replica is skipped for a while (its breaker opens: ``skip_s``, doubled per consecutive
failure up to ``MAX_SKIP_S``); once that time is over it may be tried again
(half-open), and an answer closes its breaker. When every replica is being skipped, a
call tries the one whose skip ends first, so a call never waits on more than one
replica that is known to be down. A 4xx is an answer (the replica works, the request
was refused) and never fails over. Each change of the replica in use is a failover:
counted in ``stats()``, logged with ``name`` (the caller's instance and incarnation)
and the two URLs, and reported to ``on_failover``.

Thread-safe: the replicas' state has its own lock. Time comes from an injected clock.
Must not: send anything (its users do), or retry a replica within one call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import msgspec

from kvatlas.core.breaker import Breaker, BreakerPolicy
from kvatlas.core.errors import ServiceError
from kvatlas.wire.http_api import ErrorResponse

log = logging.getLogger(__name__)

JSON_CONTENT_TYPE = "application/json"
SKIP_S = 2.0
"""How long a replica that failed is skipped at first (doubled per consecutive failure)."""
MAX_SKIP_S = 30.0
"""The longest a failing replica is skipped before it is tried again."""
REASON_CHARS = 300
"""How much of a body that is not an `ErrorResponse` a refusal quotes."""


class CoordinatorError(ServiceError):
    """The coordinator did not do what was asked; ``status`` 0 means no answer came."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class CoordinatorUnreachable(CoordinatorError):
    """No answer: the connection was refused, timed out or broke."""


class CoordinatorRefused(CoordinatorError):
    """An answer other than 2xx; ``reason`` is the coordinator's error text."""

    def __init__(self, message: str, status: int, reason: str) -> None:
        super().__init__(message, status)
        self.reason = reason


class UnknownInstance(CoordinatorRefused):
    """A heartbeat answered 404: the coordinator lost the instance (a restart without
    snapshot, or an expiry); the instance must register again."""


class BadAnswer(CoordinatorError):
    """A 2xx answer whose body does not decode into the expected shape."""


@dataclass(frozen=True, slots=True)
class Failover:
    """The client moved from one replica to another."""

    from_url: str
    to_url: str
    reason: str
    """Why the replica left behind failed (its error)."""


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    url: str
    failures: int
    """Requests to this replica that got no answer or a 5xx."""
    skipped_for_s: float
    """Seconds this replica is still skipped (its breaker is open); 0 when it is not."""


@dataclass(frozen=True, slots=True)
class ClientStats:
    """A snapshot for /status and metrics."""

    url: str
    """The replica in use."""
    failovers: int
    replicas: tuple[ReplicaStats, ...]


class _Replica:
    """One coordinator URL and its breaker; guarded by the replicas' lock."""

    __slots__ = ("base", "breaker", "failures")

    def __init__(self, base: str, policy: BreakerPolicy) -> None:
        self.base = base
        self.failures = 0
        """Requests that got no answer or a 5xx, since the start."""
        self.breaker = Breaker(policy)


class Replicas:
    """The replicas in order of preference, the one in use, and their breakers."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float,
        skip_s: float = SKIP_S,
        name: str = "",
        on_failover: Callable[[Failover], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError("a coordinator client needs at least one URL")
        # the only replica is never skipped: there is no other to ask
        policy = BreakerPolicy(
            threshold=1,
            cooloff_s=skip_s if len(urls) > 1 else 0.0,
            backoff=2.0,
            max_cooloff_s=MAX_SKIP_S,
        )
        self._replicas = [_Replica(u.rstrip("/"), policy) for u in urls]
        self.timeout_s = timeout_s
        """Each request's timeout to one replica."""
        self.clock = clock
        self._name = name
        self._on_failover = on_failover
        self._lock = threading.Lock()
        self._active = 0
        self._failovers = 0

    @property
    def url(self) -> str:
        """The base URL of the replica in use."""
        return self._replicas[self._active].base

    @property
    def urls(self) -> tuple[str, ...]:
        """Every replica's base URL, in order of preference."""
        return tuple(r.base for r in self._replicas)

    def __len__(self) -> int:
        return len(self._replicas)

    def stats(self) -> ClientStats:
        now = self.clock()
        with self._lock:
            return ClientStats(
                self._replicas[self._active].base,
                self._failovers,
                tuple(
                    ReplicaStats(r.base, r.failures, r.breaker.open_for(now))
                    for r in self._replicas
                ),
            )

    def order(self) -> list[int]:
        """The replicas a call may try: from the one in use on, those not skipped;
        when all are skipped, only the one whose skip ends first (half-open)."""
        n = len(self._replicas)
        if n == 1:
            return [0]
        now = self.clock()
        with self._lock:
            ring = [(self._active + k) % n for k in range(n)]
            usable = [i for i in ring if self._replicas[i].breaker.allows(now)]
            if usable:
                return usable
            return [min(ring, key=lambda i: self._replicas[i].breaker.open_until)]

    def failed(self, index: int) -> None:
        """Replica ``index`` gave no answer, or a 5xx: it is skipped for a while (again
        from now, and longer, when it was being skipped already)."""
        with self._lock:
            r = self._replicas[index]
            r.failures += 1
            r.breaker.record_failure(self.clock(), hard=True)

    def answered(self, index: int, reason: str) -> None:
        """Replica ``index`` answered: it becomes the one in use."""
        with self._lock:
            r = self._replicas[index]
            r.breaker.close()
            if index == self._active:
                return
            left = self._replicas[self._active]
            event = Failover(left.base, r.base, reason or f"{left.base} is skipped after failing")
            self._active = index
            self._failovers += 1
        log.warning(
            "coordinator failover%s: from %s to %s (%s)",
            f" of {self._name}" if self._name else "",
            event.from_url,
            event.to_url,
            event.reason,
        )
        if self._on_failover is not None:
            self._on_failover(event)


class ReplicaWalk:
    """One call's way over the replicas: the failover rule, in one place for the
    blocking calls (over httpx) and the loop's lookups (over their own connections).
    The replicas come in `Replicas.order` (the one in use first, skipped ones left
    out); each attempt gets the per-request timeout, or with a call deadline what is
    left of it (at most the per-request timeout when there are several replicas, so
    one cannot take the whole call's time). No answer, or a 5xx not in ``accept``,
    fails over and opens that replica's breaker (`Replicas.failed`); any other answer
    is final and makes its replica the one in use (`Replicas.answered`, which counts
    and reports a failover). When no replica answered, the error to raise is the last
    one's, naming the others'."""

    __slots__ = (
        "_deadline",
        "_method",
        "_path",
        "_replicas",
        "_timeout_s",
        "cause",
        "errors",
        "last",
    )

    def __init__(self, replicas: Replicas, method: str, path: str, timeout_s: float | None) -> None:
        self._replicas = replicas
        self._method = method
        self._path = path
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else replicas.clock() + timeout_s
        self.errors: list[str] = []
        """What each replica asked so far answered, or how it failed."""
        self.last: CoordinatorError | None = None
        self.cause: BaseException | None = None

    def attempts(self) -> Iterator[tuple[int, str, float]]:
        """Each replica to ask, as its index, the request's URL and its timeout; stops
        early once the call's deadline has passed."""
        replicas = self._replicas
        several = len(replicas) > 1
        bases = replicas.urls
        for index in replicas.order():
            timeout = replicas.timeout_s
            if self._deadline is not None:
                timeout = self._deadline - replicas.clock()
                if timeout <= 0:
                    return
                if several:  # one replica may not take the whole call's time
                    timeout = min(timeout, replicas.timeout_s)
            yield index, bases[index] + self._path, timeout

    def no_answer(self, index: int, url: str, exc: BaseException) -> None:
        """Replica ``index`` gave no answer (refused, reset, timed out): fail over."""
        self._replicas.failed(index)
        self.last = CoordinatorUnreachable(
            _with_others(f"{self._method} {url} failed: {exc!r}", self.errors)
        )
        self.cause = exc
        self.errors.append(f"{url}: {exc!r}")

    def answered(
        self,
        index: int,
        url: str,
        status: int,
        reason: str,
        accept: frozenset[int] = frozenset(),
    ) -> bool:
        """Replica ``index`` answered ``status`` (``reason``: its error text, "" for a
        2xx). False: a 5xx not in ``accept``, which fails over; True: the answer is
        final (a 4xx is too: the replica works, the request was refused)."""
        if status >= 500 and status not in accept:
            self._replicas.failed(index)
            self.last = CoordinatorRefused(
                _with_others(f"{self._method} {url} answered {status}: {reason}", self.errors),
                status,
                reason,
            )
            self.cause = None
            self.errors.append(f"{url}: {status} {reason}")
            return False
        self._replicas.answered(index, "; ".join(self.errors))
        return True

    def refused(self, url: str, status: int, reason: str) -> CoordinatorRefused:
        """The error for a final answer other than 2xx (and not accepted)."""
        return CoordinatorRefused(
            f"{self._method} {url} answered {status}: {reason}", status, reason
        )

    def failure(self) -> tuple[CoordinatorError, BaseException | None]:
        """What to raise when no replica answered, and its cause."""
        if self.last is None:  # the call's deadline ran out before any replica was asked
            return CoordinatorUnreachable(
                f"{self._method} {self._path}: no coordinator replica could be asked"
                f" within {self._timeout_s} s"
            ), None
        return self.last, self.cause


def _with_others(message: str, others: list[str]) -> str:
    """``message``, and what the replicas asked before in this call answered."""
    return f"{message} (after {'; '.join(others)})" if others else message


_error_answer = msgspec.json.Decoder(ErrorResponse)


def error_text(body: bytes) -> str | None:
    """The coordinator's error text of an answer, None when it is no `ErrorResponse`."""
    try:
        return _error_answer.decode(body).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def reason_of(body: bytes) -> str:
    """The coordinator's error text, or the start of whatever else the body is."""
    text = error_text(body)
    return body[:REASON_CHARS].decode("utf-8", "replace") if text is None else text
