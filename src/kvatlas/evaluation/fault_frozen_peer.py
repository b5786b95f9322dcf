"""The fault campaign's ``frozen_peer_no_estimate`` case: what a frozen peer costs lookups.

Owns the case as an operator met it: two cache servers with tcp P2P and the servers'
own timeouts and recompute rate (30 s, the 5 ms/token default: no
``--p2p-expected-recompute-s-per-token``), server A holding a 2,048-token prefix, A
frozen with SIGSTOP, and B's engine (a `CacheClient`, which sends no recompute
estimate) asking for the prefix. It runs twice, on a fleet of its own with no other
load, so that the times are the lookups' alone:

- ``cold``: B has never heard from A (its lock deadline is the prior);
- ``warm``: B first reads a few prefixes from a healthy A (its lock deadline is then
  learned from A's round trips), then A is frozen.

Each phase: ``BURST`` lookups at once right after the freeze (the first ones: one lock
deadline, together), then ``NEXT`` lookups ``NEXT_GAP_S`` apart (the breaker is open:
nothing is asked), then SIGCONT, the time until B's breaker on A closes (a probe), and
lookups (at most ``AFTER_TRIES``) until one reads the whole prefix from A, byte for byte
(the freeze itself waits for a closed breaker too). Every lookup is
a timeline point. Targets: the first ones within ``FIRST_TARGET_MS``, the next within
``NEXT_TARGET_MS``, one breaker opening per freeze, A served again after the thaw with
no wrong bytes. Must not: print (``say``) or write files (``fault_frozen_peer_report``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

import msgspec
import numpy as np

from kvatlas.connector.client import CacheClient
from kvatlas.evaluation.driver import KV_DTYPE, KV_LAYOUT, MODEL
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.metrics import percentiles
from kvatlas.evaluation.workload import VOCAB_SIZE, expected_kv
from kvatlas.wire.directory_api import LookupRequest

Say = Callable[[str], None]
FROZEN_PEER: Final = "frozen_peer_no_estimate"
PREFIX_TOKENS: Final = 2048
FIRST_TARGET_MS: Final = 250.0
NEXT_TARGET_MS: Final = 10.0
BURST: Final = 4
"""Lookups sent at once right after the freeze (the servers' default P2P slots)."""
NEXT: Final = 20
NEXT_GAP_S: Final = 0.05
WARM_READS: Final = 5
"""Healthy reads from A before the warm phase's freeze."""
THAW_TIMEOUT_S: Final = 15.0
AFTER_TRIES: Final = 5
"""Lookups after SIGCONT until A serves the prefix (the first may meet a breaker that a
busy machine's scheduling delay opened again); each is a timeline point."""


@dataclass(frozen=True, slots=True)
class FrozenPeerConfig:
    """What the case takes from the campaign's ``FaultsConfig``."""

    chunk_size: int = 256
    chunk_bytes: int = 64 * 1024
    l1_size_mb: float = 64.0
    seed: int = 13
    fleet: FleetConfig = field(default_factory=FleetConfig)
    """Process settings; the case sets two nodes, P2P and the servers' own timeouts."""

    def fleet_config(self) -> FleetConfig:
        """Two servers with P2P and the servers' default timeouts and recompute rate."""
        return replace(
            self.fleet,
            nodes=2,
            chunk_size=self.chunk_size,
            l1_size_mb=self.l1_size_mb,
            p2p=True,
            p2p_lookup_timeout_s=30.0,
            p2p_load_timeout_s=30.0,
            server_args=(),
        )


class _Case:
    def __init__(self, cfg: FrozenPeerConfig, fleet: Fleet) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.a = self._client(0, "eval-frozen-holder")
        self.bs = [self._client(1, f"eval-frozen-reader-{j}") for j in range(BURST)]
        self._prompts = 0

    def _client(self, k: int, engine_id: str) -> CacheClient:
        c = CacheClient(self.fleet.servers[k].engine_url, timeout_s=60.0, engine_id=engine_id)
        c.register(MODEL, KV_DTYPE, KV_LAYOUT, chunk_size=self.cfg.chunk_size)
        return c

    def close(self) -> None:
        for c in (self.a, *self.bs):
            c.close()

    def held_prompt(self, tokens: int) -> np.ndarray:
        """A prompt of ``tokens`` nobody holds yet, stored on A and listed for it."""
        self._prompts += 1
        rng = np.random.default_rng([self.cfg.seed, 30, self._prompts])
        prompt = rng.integers(0, VOCAB_SIZE, tokens, dtype=np.int64)
        hashes = self.a.hashes(prompt)
        arrays = [expected_kv(h, self.cfg.chunk_bytes) for h in hashes]
        stored = self.a.store_chunks(prompt, arrays)
        if stored.stored != len(hashes):
            raise RuntimeError(f"A stored {stored.stored} of {len(hashes)} chunks")
        ask = LookupRequest(tokens_b64=prompt.astype("<u4").tobytes(), model_name=MODEL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            resp = self.fleet.lookup(ask)
            if (
                resp is not None
                and len(resp.results) == len(hashes)
                and all(any(p.instance_id == "node-0" for p in r.placements) for r in resp.results)
            ):
                return prompt
            time.sleep(0.05)
        raise RuntimeError("the directory never listed A's prompt")

    def lookup(self, c: CacheClient, prompt: np.ndarray, phase: str) -> dict[str, Any]:
        """One lookup with read leases, no estimate; every byte got is compared. Its
        ``t_s`` is the monotonic start until ``phase`` makes it relative to the freeze."""
        t = time.monotonic()
        res = c.lookup(prompt, acquire=True)
        took = time.monotonic() - t
        try:
            wrong = sum(
                1
                for loc in res.chunks
                if not np.array_equal(
                    c.view(loc.offset, loc.size), expected_kv(loc.hash, self.cfg.chunk_bytes)
                )
            )
        finally:
            c.release([loc.lease_id for loc in res.chunks])
        return {
            "phase": phase,
            "t_s": t,
            "ms": round(took * 1000, 2),
            "chunks": res.total_chunks,
            "hit": res.hit_chunks,
            "peer": res.peer_chunks,
            "fallback": res.p2p_fallback,
            "lock_ms": round(res.p2p_ms.get("lock", 0.0), 2),
            "wrong": wrong,
        }

    def wait_closed(self) -> float | None:
        """Seconds until B's breaker on A is closed (None: not within THAW_TIMEOUT_S)."""
        t = time.monotonic()
        while time.monotonic() - t < THAW_TIMEOUT_S:
            if not self.b_p2p().get("cooling_peers", ["?"]):
                return time.monotonic() - t
            time.sleep(0.02)
        return None

    def b_p2p(self) -> dict[str, Any]:
        st = self.fleet.server_status(1)
        if st is None or st.p2p is None:
            return {}
        out: dict[str, Any] = msgspec.to_builtins(st.p2p)
        return out

    def phase(self, name: str, warm: bool, say: Say) -> dict[str, Any]:
        points: list[dict[str, Any]] = []
        if warm:
            for _ in range(WARM_READS):
                small = self.held_prompt(self.cfg.chunk_size * 2)
                points.append(self.lookup(self.bs[0], small, "healthy"))
        prompt = self.held_prompt(PREFIX_TOKENS)
        # the freeze must meet a closed breaker (a healthy read that a busy machine made
        # late may have opened it; a probe closes it again)
        self.wait_closed()
        before = self.b_p2p()
        a = self.fleet.servers[0]
        self.fleet.freeze(a)
        t_freeze = time.monotonic()
        try:
            burst: list[dict[str, Any]] = []
            go = threading.Barrier(BURST)

            def one(c: CacheClient) -> None:
                go.wait()
                burst.append(self.lookup(c, prompt, "first"))

            threads = [threading.Thread(target=one, args=(c,)) for c in self.bs]
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            points += sorted(burst, key=lambda p: p["t_s"])
            for _ in range(NEXT):
                time.sleep(NEXT_GAP_S)
                points.append(self.lookup(self.bs[0], prompt, "next"))
            frozen = self.b_p2p()
        finally:
            self.fleet.thaw(a)
        t_thaw = time.monotonic()
        closed_s = self.wait_closed()
        for _ in range(AFTER_TRIES):
            points.append(self.lookup(self.bs[0], prompt, "after"))
            if points[-1]["peer"] == points[-1]["chunks"]:
                break
            self.wait_closed()
        for p in points:
            p["t_s"] = round(p["t_s"] - t_freeze, 4)
        timing = next((t for t in frozen.get("peer_timings", []) if t["peer"] == "node-0"), None)
        first = [p["ms"] for p in points if p["phase"] == "first"]
        nxt = [p["ms"] for p in points if p["phase"] == "next"]
        healthy_lock = [p["lock_ms"] for p in points if p["phase"] == "healthy"]
        after = points[-1]
        opened = frozen.get("breakers_opened", 0) - before.get("breakers_opened", 0)
        targets = {
            "first_within_target": max(first) <= FIRST_TARGET_MS,
            "next_within_target": max(nxt) <= NEXT_TARGET_MS,
            "one_breaker_opening": opened == 1,
            "served_after_thaw": after["peer"] == after["chunks"] and not after["fallback"],
            "no_wrong_bytes": sum(p["wrong"] for p in points) == 0,
        }
        res = {
            "phase": name,
            "first_ms": percentiles(first, 1.0),
            "next_ms": percentiles(nxt, 1.0),
            "healthy_lock_ms": percentiles(healthy_lock, 1.0),
            "lock_deadline_ms": None if timing is None else timing["last_lock_deadline_ms"],
            "lock_deadline_prior_ms": frozen.get("lock_deadline_prior_ms"),
            "breakers_opened": opened,
            "after_thaw_tries": sum(p["phase"] == "after" for p in points),
            "sigcont_s": round(t_thaw - t_freeze, 4),
            "breaker_closed_after_thaw_s": None if closed_s is None else round(closed_s, 3),
            "fallbacks": sorted({p["fallback"] for p in points if p["fallback"]}),
            "targets": targets,
            "passed": all(targets.values()),
            "timeline": points,
        }
        say(
            f"  {FROZEN_PEER} ({name}): first {max(first):.1f} ms (target {FIRST_TARGET_MS:g}),"
            f" next max {max(nxt):.1f} ms (target {NEXT_TARGET_MS:g}), lock deadline"
            f" {res['lock_deadline_ms']} ms, breaker closed {res['breaker_closed_after_thaw_s']}"
            f" s after SIGCONT; {'PASS' if res['passed'] else 'FAIL'}"
        )
        return res


def run_frozen_peer(cfg: FrozenPeerConfig, say: Say) -> dict[str, Any]:
    """The case on a two-server fleet of its own; its result document."""
    fcfg = cfg.fleet_config()
    t = time.monotonic()
    with Fleet(fcfg) as fleet:
        fleet.start(lambda m: say(f"  {m}"))
        fleet.wait_p2p_peers(30)
        case = _Case(cfg, fleet)
        try:
            phases = [case.phase("cold", False, say), case.phase("warm", True, say)]
        finally:
            case.close()
    return {
        "name": FROZEN_PEER,
        "title": f"a frozen peer holding a {PREFIX_TOKENS}-token prefix; lookups without a"
        " recompute estimate (the server's default 5 ms/token: 10.24 s)",
        "targets_ms": {"first": FIRST_TARGET_MS, "next": NEXT_TARGET_MS},
        "fleet": asdict(fcfg),
        "elapsed_s": round(time.monotonic() - t, 1),
        "phases": phases,
        "passed": all(p["passed"] for p in phases),
    }
