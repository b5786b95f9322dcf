"""Which tier holds how much of a prompt for each engine, and which tier won a decision.

Owns, pure, for one request: the leading prompt tokens each engine can skip computing,
from every source the router has, per tier:

- ``device``: the engine's own prefix cache (vLLM's GPU blocks, from the coordinator's
  device lookup over vLLM's KV events);
- ``l1`` / ``l2``: its node's cache server (the coordinator's chunk lookup), or blocks
  published as KV events with medium ``CPU`` / ``STORAGE`` (an engine's CPU offload, a
  kvatlas server's own tiers);
- ``pending``: a prefix the router sent it moments ago (``PendingPrefixes``);
- ``peer``: tokens beyond those that another node holds (``kv-p2p`` reads them).

A device-lookup hit belongs to a router engine whose URL it names (the coordinator's
``--vllm-kv-events ...,url=``), else to the engines whose cache instance id is its
engine id (a data-parallel rank ``ID/dpN`` counts for ``ID``). An engine's local
tokens are its best tier's; ties go to the cheaper tier to load (device, then l1, l2,
pending). The tier that won a choice is the local one unless the tokens a peer adds
are more (``peer``), or ``none`` when nothing is cached.

Every tier answers a request the same way (``TierSource``, as SGLang's prefix caches
share ``BasePrefixCache``): ``Match`` es, the leading tokens one engine (by URL, or by
cache instance or engine id) holds in one tier, and whether the answer lets the router
route by KV at all; ``TierView`` reads the answers of all of them. ``tier_gather``
gathers them for a request, in one place.

Must not: do I/O, read clocks, or rank engines (``policy.Chooser`` does).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

Tier = Literal["device", "l1", "l2", "pending", "peer", "none"]
TIERS: Final[tuple[Tier, ...]] = ("device", "l1", "l2", "pending", "peer", "none")
_LOCAL_ORDER: Final[tuple[Tier, ...]] = ("device", "l1", "l2", "pending")


@dataclass(frozen=True, slots=True)
class DeviceHit:
    """One engine of the coordinator's device lookup."""

    engine: str
    tokens: int
    media: tuple[str, ...] = ("GPU",)
    url: str | None = None


def hit_tier(media: Sequence[str]) -> Tier:
    """The tier of a device hit by the media holding all of its blocks: the engine's
    GPU (or a mix with no common medium) is ``device``; CPU alone ``l1``; STORAGE
    alone ``l2``."""
    names = {m.upper() for m in media}
    if "GPU" in names or not names:
        return "device"
    if "CPU" in names:
        return "l1"
    if "STORAGE" in names:
        return "l2"
    return "device"


def engine_base(engine: str) -> str:
    """A data-parallel rank's engine id (``ID/dpN``) as its engine's id."""
    head, sep, rank = engine.rpartition("/dp")
    return head if sep and rank.isdigit() else engine


@dataclass(frozen=True, slots=True)
class Held:
    """Leading prompt tokens one engine holds, per local tier."""

    device: int = 0
    l1: int = 0
    l2: int = 0
    pending: int = 0

    def best(self) -> tuple[Tier, int]:
        """The tier holding the most (the cheaper one on a tie) and its tokens."""
        tier: Tier = "none"
        most = 0
        for name in _LOCAL_ORDER:
            tokens: int = getattr(self, name)
            if tokens > most:
                tier, most = name, tokens
        return tier, most


@dataclass(frozen=True, slots=True)
class Match:
    """Leading prompt tokens one engine holds in one local tier, as a tier answers them."""

    tier: Tier
    tokens: int
    url: str = ""
    """The router engine's URL it belongs to ("": by ``engine`` alone)."""
    engine: str = ""
    """The cache instance id (or vLLM engine id) it belongs to ("": by ``url`` alone)."""
    shared: bool = False
    """Held by a cache server, so a peer can read it (what ``TierView.fleet`` counts)."""


@dataclass(frozen=True, slots=True)
class TierAnswer:
    """One tier's answer for one request."""

    matches: tuple[Match, ...] = ()
    routes: bool = False
    """Whether this answer lets the router rank by KV: without one that does, the
    request routes by load (the chunk tier answered; the device tier found a prefix)."""


NO_ANSWER: Final = TierAnswer()
"""A tier not asked, failed, out or past its deadline: it knows nothing of the prompt."""


@dataclass(frozen=True, slots=True)
class Ask:
    """What every tier is asked about: one request's prompt."""

    blob: bytes
    """The prompt's token ids, little-endian uint32."""
    model: str
    """The model name the fleet hashes under ("": unknown)."""
    salt: str = ""
    """The request's ``cache_salt``: KV of another salt is none of its."""
    ids_at: float = 0.0
    """When the ids were ready (``time.perf_counter``): the router's ``hash`` step
    (the prompt's prefixes hashed) is timed from here."""


class TierSource(Protocol):
    """One tier as the router asks it (``chunk``, ``device``, ``pending``)."""

    @property
    def name(self) -> str:
        """The tier's name in logs."""
        ...

    def asks(self, ask: Ask) -> bool:
        """Whether this request's lookup is made at all (False: no task made for it;
        the tier counts a skip where it counts them)."""
        ...

    def answer(self, ask: Ask) -> Awaitable[TierAnswer]:
        """The tier's answer within its own deadline; never raises for the tier's own
        failure or timeout: it counts it (its metric, its breaker) and answers
        ``NO_ANSWER``. A tier that answers without waiting returns a done future."""
        ...


def chunk_matches(holders: Iterable[tuple[str, str, int]]) -> tuple[Match, ...]:
    """The chunk lookup's (instance id, tier, tokens) as matches (any tier but ``l2``
    is ``l1``)."""
    return tuple(
        Match("l2" if tier == "l2" else "l1", tokens, engine=instance, shared=True)
        for instance, tier, tokens in holders
    )


def device_matches(hits: Iterable[DeviceHit]) -> tuple[Match, ...]:
    """The device lookup's hits as matches: by the URL a hit names, else by its engine
    id (a data-parallel rank's as its engine's)."""
    return tuple(
        Match(hit_tier(hit.media), hit.tokens, url=hit.url.rstrip("/"))
        if hit.url
        else Match(hit_tier(hit.media), hit.tokens, engine=engine_base(hit.engine))
        for hit in hits
        if hit.tokens > 0
    )


def pending_matches(pending: Mapping[str, int]) -> tuple[Match, ...]:
    """Engine URL -> tokens sent to it moments ago, as matches."""
    return tuple(Match("pending", tokens, url=url) for url, tokens in pending.items())


class TierView:
    """One request's holdings per engine (see the module doc)."""

    def __init__(self, matches: Iterable[Match]) -> None:
        """``matches``: every tier's answer's (``chunk_matches``, ``device_matches``,
        ``pending_matches``)."""
        self.fleet = 0
        """The most leading tokens any cache server holds (what a peer read can give)."""
        self._by_url: dict[tuple[str, Tier], int] = {}
        self._by_id: dict[tuple[str, Tier], int] = {}
        for m in matches:
            if m.shared:
                self.fleet = max(self.fleet, m.tokens)
            for table, name in ((self._by_url, m.url), (self._by_id, m.engine)):
                if name:
                    table[(name, m.tier)] = max(table.get((name, m.tier), 0), m.tokens)

    def held(self, url: str, instance_id: str) -> Held:
        """What the engine at ``url`` (of cache instance ``instance_id``) holds."""

        def get(tier: Tier) -> int:
            return max(self._by_url.get((url, tier), 0), self._by_id.get((instance_id, tier), 0))

        return Held(device=get("device"), l1=get("l1"), l2=get("l2"), pending=get("pending"))

    def local(self, url: str, instance_id: str) -> int:
        """Leading tokens the engine need not compute nor read from a peer."""
        return self.held(url, instance_id).best()[1]

    def tier_of(self, url: str, instance_id: str, cached_tokens: int) -> Tier:
        """Which tier gives most of the ``cached_tokens`` a choice expects."""
        if cached_tokens <= 0:
            return "none"
        tier, local = self.held(url, instance_id).best()
        return "peer" if cached_tokens - local > local else tier

    def tiers(self, choices: Iterable[tuple[str, str, int]]) -> dict[str, Tier]:
        """Per (url, instance id, cached tokens) of a ranking: url -> its tier."""
        return {url: self.tier_of(url, inst, cached) for url, inst, cached in choices}
