"""The router's prefix lookups at the coordinator, and the coordinator's breaker.

Owns one lookup per routed request: the prompt's tokens (uint32 bytes) to the
coordinator through ``AsyncLookups`` (msgpack on a keep-alive connection of this
loop's), which answers every instance's cached prefix of them (the coordinator hashes
them with the fleet's contract). A failed lookup takes the coordinator out (its breaker,
`core.breaker`): the lookups waiting on it end at once (``tripwires``), and no request
asks it again until, after ``coordinator_backoff_s``, one lookup in the background (a
trial, half-open: no request waits on it) finds it answering. So a coordinator that is
down or frozen (its sockets accept, nothing answers) costs the requests in flight when
it stopped at most one ``lookup_timeout_s``, and the rest nothing: they route by load.
As a tier (``tiers.TierSource``, ``chunk``): the holders' l1 and l2 prefixes, an answer
that routes whenever the coordinator answered.

Single-threaded: the router's event loop owns it. Must not: tokenize, choose an engine,
or block the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvatlas.core.breaker import Breaker, BreakerPolicy, BreakerState
from kvatlas.router.config import RouterConfig
from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.tiers import NO_ANSWER, Ask, TierAnswer, chunk_matches
from kvatlas.router.tripwires import COORDINATOR, Tripped, Tripwires
from kvatlas.runtime.coordinator_client import CoordinatorError
from kvatlas.runtime.coordinator_lookups import AsyncLookups

log = logging.getLogger(__name__)


class CoordinatorLookups:
    """Prefix lookups behind the coordinator's breaker (see the module doc)."""

    name = "chunk"

    def __init__(
        self,
        config: RouterConfig,
        lookups: AsyncLookups | None,
        wires: Tripwires,
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._lookups = lookups
        self._wires = wires
        self._metrics = metrics
        self._clock = clock
        self.breaker = Breaker(BreakerPolicy(threshold=1, cooloff_s=config.coordinator_backoff_s))
        self._trial: asyncio.Task[None] | None = None
        metrics.coordinator_available.set(1 if lookups is not None else 0)

    def asks(self, ask: Ask) -> bool:
        """Without a coordinator or a model name there is no chunk lookup to make."""
        return self._lookups is not None and bool(ask.model)

    async def answer(self, ask: Ask) -> TierAnswer:
        """The chunk tier's answer (``holders``); ``NO_ANSWER`` where that is None."""
        holders = await self.holders(ask.blob, ask.model, ask.salt)
        return NO_ANSWER if holders is None else TierAnswer(chunk_matches(holders), routes=True)

    async def holders(
        self, blob: bytes, model: str, salt: str = ""
    ) -> list[tuple[str, str, int]] | None:
        """(instance, tier, leading tokens held) for every holder of the prompt's prefix
        under ``salt`` (the request's ``cache_salt``: KV of another salt is none of its); None
        without a coordinator, a model name, or an answer in time, and while the
        coordinator is out (see the module doc). Only a lookup that was needed and
        failed (the coordinator out or not answering) counts as degraded: without a
        coordinator or a model name there is no chunk lookup to make (a plain vLLM
        fleet, which the device tier routes alone)."""
        if self._lookups is None or not model:
            return None
        if not self._may_ask(blob, model):
            self._metrics.degraded.labels("lookup").inc()
            return None
        t0 = time.perf_counter()
        try:
            async with self._wires.arm(COORDINATOR, "lookup"):
                answer = await self._lookups.holders(
                    blob, model, timeout_s=self._config.lookup_timeout_s, cache_salt=salt
                )
        except Tripped:  # another lookup found the coordinator out
            self._metrics.degraded.labels("lookup").inc()
            return None
        except CoordinatorError as exc:
            self._out(exc)
            self._metrics.degraded.labels("lookup").inc()
            return None
        self._metrics.observe("lookup", time.perf_counter() - t0)
        if answer.server_s is not None:
            self._metrics.observe("lookup_server", answer.server_s)
        return [(h.instance_id, h.tier, h.tokens) for h in answer.holders]

    def _may_ask(self, blob: bytes, model: str) -> bool:
        """Whether a request may ask the coordinator now: yes while it answers; while it
        is out, no, and once its backoff is over this request's lookup is sent as the
        trial, in the background (the request routes by load)."""
        state = self.breaker.state(self._clock())
        if state is BreakerState.CLOSED:
            return True
        if self._trial is None and state is BreakerState.HALF_OPEN:
            self._trial = asyncio.create_task(self._try(blob, model))
        return False

    def _out(self, exc: CoordinatorError) -> None:
        """A lookup failed: the coordinator is out for ``coordinator_backoff_s``, and the
        lookups waiting on it end now."""
        now = self._clock()
        was_in = self.breaker.state(now) is BreakerState.CLOSED
        self.breaker.record_failure(now)
        self._metrics.coordinator_available.set(0)
        n = self._wires.trip(COORDINATOR, "out", ("lookup",))
        if was_in:
            log.warning(
                "router: coordinator lookup failed, routing by load (trying it again every"
                " %.1f s, in the background; %d other lookup(s) ended): %s",
                self._config.coordinator_backoff_s, n, exc,
            )  # fmt: skip

    async def _try(self, blob: bytes, model: str) -> None:
        """The trial lookup of a coordinator that is out: back in when it answers."""
        assert self._lookups is not None
        try:
            await self._lookups.holders(blob, model, timeout_s=self._config.lookup_timeout_s)
        except CoordinatorError as exc:
            self.breaker.record_failure(self._clock())
            log.debug("router: the coordinator is still out: %s", exc)
        else:
            self.breaker.close()
            self._metrics.coordinator_available.set(1)
            log.info("router: the coordinator answers again: routing by %s", self._config.policy)
        finally:
            self._trial = None

    async def aclose(self) -> None:
        """Cancel a trial under way; close the lookups' connections."""
        if self._trial is not None:
            self._trial.cancel()
            await asyncio.gather(self._trial, return_exceptions=True)
        if self._lookups is not None:
            await self._lookups.aclose()
