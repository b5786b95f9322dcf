"""Engines' prefill rates (seconds per token), learned from what they send.

A lookup that reaches for peers is bounded by the time recomputing the missing tokens
would take. An engine that measured its prefills says so on each lookup (the connector
sends ``prefill_s_per_token`` beside its ``recompute_s`` estimate); one that sends only
an estimate gives its rate as ``recompute_s / tokens``. ``RecomputeRates`` keeps an EWMA
per (model, engine) and per model, so that a lookup with no estimate (an engine that has
not measured yet, or a client that never estimates) is bounded by what this engine, else
any engine of the same model on this server, was last seen to prefill at; only when no
engine of the model ever said is the server's flag the fallback (the caller's choice).

Bounded: at most ``max_engines`` engines are remembered, the least recently heard from
are dropped first. Pure: no clock, no I/O, single-threaded (the engine service calls it
under its lock). Must not: choose the fallback when nothing is known (the caller's flags).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Final

ALPHA: Final = 0.3
"""Weight of the newest rate in the EWMAs."""
MAX_S_PER_TOKEN: Final = 10.0
"""Rates above this are not a prefill (a stalled engine, a unit mistake): ignored."""


class RecomputeRates:
    """Prefill seconds per token per (model, engine) and per model."""

    def __init__(self, max_engines: int = 256) -> None:
        self.max_engines = max_engines
        self._engines: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._models: dict[str, float] = {}
        self.observed = 0
        self.ignored = 0
        """Rates refused (not finite, not positive, above ``MAX_S_PER_TOKEN``)."""

    def observe(self, model: str, engine: str, s_per_token: float) -> bool:
        """One rate an engine measured or implied; False when it is not plausible."""
        if not (math.isfinite(s_per_token) and 0 < s_per_token <= MAX_S_PER_TOKEN):
            self.ignored += 1
            return False
        self.observed += 1
        key = (model, engine)
        prev = self._engines.pop(key, None)
        self._engines[key] = s_per_token if prev is None else prev + ALPHA * (s_per_token - prev)
        while len(self._engines) > self.max_engines:
            self._engines.popitem(last=False)
        m = self._models.get(model)
        self._models[model] = s_per_token if m is None else m + ALPHA * (s_per_token - m)
        return True

    def rate(self, model: str, engine: str) -> float | None:
        """This engine's rate, else its model's on this server; None when neither is known."""
        r = self._engines.get((model, engine))
        return r if r is not None else self._models.get(model)

    def by_model(self) -> dict[str, float]:
        return dict(sorted(self._models.items()))

    def engines(self) -> int:
        return len(self._engines)
