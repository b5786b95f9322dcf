"""The router's choice of engine: pure scoring of candidates, no I/O.

Owns the policies of ``kvatlas router --policy``:

- ``kv``: an engine costs the prefill its node would still compute (prompt tokens minus
  the leading tokens its cache server holds) plus its load (queued prefill tokens and a
  decode allowance per request in flight), all in prefill-token equivalents;
- ``kv-p2p``: as ``kv``, but the tokens some other node holds beyond this node's prefix
  cost a P2P read, not a recompute, so a hot prefix need not pin its traffic to the one
  engine that computed it. A read token costs ``Candidate.p2p_weight`` prefill tokens:
  the fleet's measured P2P seconds per token over the engine's measured prefill seconds
  per token; ``Weights.p2p`` until both are measured;
- ``least-loaded``: the load term alone;
- ``round-robin`` and ``random``: the usual.

Near-ties (within ``Weights.tie`` of the prompt's prefill cost) go to the engine that
would compute the fewest tokens, then to fewer requests in flight, then in turn, so that
a prefix is not computed twice when waiting for it costs about the same, and equal
engines share the load. Every
decision ranks all candidates: the router retries down that order.

Must not: do I/O, read clocks, or keep anything but the round-robin position (the
caller passes the random source).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

Policy = Literal["kv", "kv-p2p", "least-loaded", "round-robin", "random"]
POLICIES: Final[tuple[str, ...]] = ("kv", "kv-p2p", "least-loaded", "round-robin", "random")
KV_POLICIES: Final = frozenset({"kv", "kv-p2p"})


@dataclass(frozen=True, slots=True)
class Weights:
    """The cost model's weights, in prefill-token equivalents (flags ``--weight-*``)."""

    p2p: float = 0.1
    """Cost of one token read from a peer, relative to recomputing it, until the router
    has measured both rates (``--weight-p2p``)."""
    load: float = 1.0
    """Weight of the load term against the prompt's own prefill (``--weight-load``)."""
    decode: float = 64.0
    """Prefill tokens one request in flight is worth, for its decode (``--weight-decode``)."""
    tie: float = 0.25
    """Costs within this share of the prompt's prefill are near-ties (``--weight-tie``).
    Wide enough that a request for a prefix another engine is prefilling right now (its
    queue holds that prefill) ties with computing it again on an idle engine."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One healthy engine as the router sees it at the moment of the choice."""

    name: str
    in_flight: int
    """Requests the router has sent it and not yet seen finish, plus those of other
    clients that the engine's last probe ran (``EngineState.load``)."""
    queued_tokens: int
    """Prefill tokens of the requests in flight (the router's expectation)."""
    local_tokens: int = 0
    """Leading prompt tokens its node's cache server holds (from the coordinator)."""
    p2p_weight: float | None = None
    """Prefill tokens one token read from a peer costs it, from the measured rates
    (``EngineTable.p2p_weight``); None: ``Weights.p2p``."""


@dataclass(frozen=True, slots=True)
class Choice:
    """One ranked candidate: its cost and the tokens it is expected to find cached."""

    name: str
    cost: float
    cached_tokens: int
    prefill_tokens: int
    """Prompt tokens it is expected to compute (what its queue grows by)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The ranking (best first) and why the first is first."""

    ranked: tuple[Choice, ...]
    reason: str


class Chooser:
    """Ranks candidates under one policy; keeps only the round-robin position."""

    def __init__(self, policy: Policy, weights: Weights, rng: random.Random) -> None:
        self.policy = policy
        self.weights = weights
        self._rng = rng
        self._turn = 0

    def rank(
        self,
        candidates: Sequence[Candidate],
        prompt_tokens: int,
        fleet_tokens: int,
        *,
        policy: Policy | None = None,
    ) -> Decision:
        """Rank ``candidates`` (non-empty) for a prompt of ``prompt_tokens`` of which the
        fleet holds ``fleet_tokens`` leading tokens somewhere; ``policy`` overrides the
        configured one (the router degrades to ``least-loaded`` without a lookup)."""
        policy = policy or self.policy
        self._turn += 1
        if policy == "round-robin":
            k = self._turn % len(candidates)
            order = [*candidates[k:], *candidates[:k]]
            return Decision(tuple(self._plain(c, prompt_tokens) for c in order), policy)
        if policy == "random":
            order = list(candidates)
            self._rng.shuffle(order)
            return Decision(tuple(self._plain(c, prompt_tokens) for c in order), policy)
        scored = [self._score(c, policy, prompt_tokens, fleet_tokens) for c in candidates]
        best = min(s.cost for s in scored)
        slack = self.weights.tie * max(prompt_tokens, 1)
        n = len(candidates)
        load = {c.name: c.in_flight for c in candidates}

        def key(item: tuple[int, Choice]) -> tuple[bool, float, int, int, int]:
            i, s = item
            near = s.cost <= best + slack
            # near-ties: the least to compute first (a request that would wait about as
            # long behind the engine prefilling its prefix as it would take to compute
            # it elsewhere waits, instead of computing it twice), then fewer in flight,
            # then in turn (``least-loaded``: by load alone); the rest by cost
            compute = s.prefill_tokens if policy in KV_POLICIES else 0
            return (
                not near, 0.0 if near else s.cost, compute, load[s.name], (i - self._turn) % n,
            )  # fmt: skip

        ranked = tuple(s for _, s in sorted(enumerate(scored), key=key))
        first = ranked[0]
        if policy == "least-loaded":
            reason = "least-loaded"
        elif first.cached_tokens > 0:
            reason = f"{policy}: prefix"
        else:
            reason = f"{policy}: load"
        return Decision(ranked, reason)

    def _plain(self, c: Candidate, prompt_tokens: int) -> Choice:
        cached = min(c.local_tokens, prompt_tokens)
        return Choice(c.name, 0.0, cached, prompt_tokens - cached)

    def _score(self, c: Candidate, policy: Policy, prompt: int, fleet: int) -> Choice:
        w = self.weights
        load = w.load * (c.queued_tokens + w.decode * c.in_flight)
        local = min(c.local_tokens, prompt)
        if policy == "least-loaded":
            return Choice(c.name, load, local, prompt - local)
        peer = max(0, min(fleet, prompt) - local) if policy == "kv-p2p" else 0
        compute = prompt - local - peer
        p2p = w.p2p if c.p2p_weight is None else c.p2p_weight
        cost = compute + p2p * peer + load
        return Choice(c.name, cost, local + peer, compute)
