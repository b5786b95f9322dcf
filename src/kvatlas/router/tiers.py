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

Must not: do I/O, read clocks, or rank engines (``policy.Chooser`` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

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


class TierView:
    """One request's holdings per engine (see the module doc)."""

    def __init__(
        self,
        holders: Iterable[tuple[str, str, int]],
        hits: Iterable[DeviceHit],
        pending: Mapping[str, int],
    ) -> None:
        """``holders``: the chunk lookup's (instance id, tier, tokens); ``hits``: the
        device lookup's; ``pending``: engine URL -> tokens sent to it moments ago."""
        self._chunks: dict[tuple[str, str], int] = {}
        self.fleet = 0
        """The most leading tokens any cache server holds (what a peer read can give)."""
        for instance, tier, tokens in holders:
            key = (instance, tier if tier in ("l1", "l2") else "l1")
            self._chunks[key] = max(self._chunks.get(key, 0), tokens)
            self.fleet = max(self.fleet, tokens)
        self._by_url: dict[tuple[str, Tier], int] = {}
        self._by_id: dict[tuple[str, Tier], int] = {}
        for hit in hits:
            if hit.tokens <= 0:
                continue
            tier = hit_tier(hit.media)
            table, name = (
                (self._by_url, hit.url.rstrip("/"))
                if hit.url
                else (self._by_id, engine_base(hit.engine))
            )
            table[(name, tier)] = max(table.get((name, tier), 0), hit.tokens)
        self._pending = pending

    def held(self, url: str, instance_id: str) -> Held:
        """What the engine at ``url`` (of cache instance ``instance_id``) holds."""

        def get(tier: Tier) -> int:
            return max(self._by_url.get((url, tier), 0), self._by_id.get((instance_id, tier), 0))

        return Held(
            device=get("device"),
            l1=max(get("l1"), self._chunks.get((instance_id, "l1"), 0)),
            l2=max(get("l2"), self._chunks.get((instance_id, "l2"), 0)),
            pending=self._pending.get(url, 0),
        )

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
