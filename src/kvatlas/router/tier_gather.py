"""Every tier's answer for one request, gathered in one place: the router's only way to
learn where a prompt's KV is.

Owns asking the tiers (``tiers.TierSource``: the prefixes sent moments ago, the
coordinator's chunk lookup, its device lookup) for one prompt, at once, and what the
answers make: a ``TierView`` and whether the request may be ranked by KV (one answer
that ``routes``; else the router routes it by load). Tiers that answer without waiting
(``pending``) cost no task, and a lone lookup is awaited as it is; two lookups run
beside each other, so a request waits for the slower, never for their sum.

Also the ``pending`` tier's source: ``PendingPrefixes`` (pure, time a parameter) read
on the router's clock, timing the ``hash`` step it is.

Must not: decide what a tier's failure means (each tier counts its own and answers
``NO_ANSWER``), rank engines, or block the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.pending import PendingPrefixes
from kvatlas.router.tiers import Ask, TierAnswer, TierSource, TierView, pending_matches


@dataclass(frozen=True, slots=True)
class Gathered:
    """Every tier's answers for one request."""

    view: TierView
    routes: bool
    """Whether some tier's answer lets the router rank by KV."""


class TierGather:
    """The tiers a router asks, in order (see the module doc)."""

    def __init__(self, sources: Sequence[TierSource]) -> None:
        self.sources = tuple(sources)

    async def gather(self, ask: Ask) -> Gathered:
        """Ask every tier that is asked for this request; never raises for a tier's
        failure (see ``TierSource.answer``)."""
        waits = [s.answer(ask) for s in self.sources if s.asks(ask)]
        slow = [w for w in waits if not (isinstance(w, asyncio.Future) and w.done())]
        answers: Sequence[TierAnswer]
        if len(slow) > 1:
            answers = await asyncio.gather(*waits)
        else:  # nothing to run beside anything: no task made
            answers = [await w for w in waits]
        return Gathered(
            TierView(m for a in answers for m in a.matches), any(a.routes for a in answers)
        )


class PendingTier:
    """``pending`` as a tier: the prefixes the router sent an engine within their TTL."""

    name = "pending"

    def __init__(
        self, prefixes: PendingPrefixes, metrics: RouterMetrics, clock: Callable[[], float]
    ) -> None:
        self._prefixes = prefixes
        self._metrics = metrics
        self._clock = clock

    def asks(self, ask: Ask) -> bool:
        return True

    def answer(self, ask: Ask) -> Awaitable[TierAnswer]:
        """Answered at once (a done future): the prompt's prefixes hashed and looked up."""
        leading = self._prefixes.leading(ask.blob, self._clock(), ask.salt)
        self._metrics.observe("hash", time.perf_counter() - ask.ids_at)
        done: asyncio.Future[TierAnswer] = asyncio.get_running_loop().create_future()
        done.set_result(TierAnswer(pending_matches(leading)))
        return done
