"""The churn phase: servers killed and restarted, the coordinator stopped, under load.

Owns the churn scenario and its measurements. While the workload runs at a steady rate:

1. warm-up, then ``kill -9`` one server (no deregistration): measure the time until the
   coordinator has fenced that incarnation's L1 slice (no placement of it left in
   ``GET /directory/stats``), which the instance timeout bounds;
2. restart it with the same instance id (a new incarnation) and wait until it registers;
3. stop the coordinator (SIGTERM: it writes its snapshot) for ``coordinator_outage_s``, then
   start it again at the same address: measure the time until every live server's events
   are delivered again (catch-up) and count events lost (publisher drops, gate gaps);
4. keep the load on a while, then check the invariants against the processes.

The stale-hint ratio is reported per window of the scenario (before, owner dead, fenced,
restarted, coordinator down, after). Must not: print; progress goes through ``say``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvatlas.evaluation.driver import NodeDriver, RequestRecord
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.fleet_phase import drive
from kvatlas.evaluation.invariants import (
    events_lost,
    inventory_check,
    request_invariants,
    wait_delivered,
)
from kvatlas.evaluation.metrics import (
    heartbeat_summary,
    hint_summary,
    hit_series,
    hit_summary,
    p2p_delta,
    percentiles,
    stale_series,
)
from kvatlas.evaluation.observe import (
    Sampler,
    cursors,
    owner_placements,
    stale_hint_fallbacks,
)
from kvatlas.evaluation.workload import Request

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ChurnConfig:
    """Timings of the scenario, in seconds of wall time."""

    warmup_s: float = 6.0
    """Load before the first kill."""
    fence_timeout_s: float = 30.0
    """Give up waiting for the fence after this long (the run then reports no fence)."""
    dead_hold_s: float = 1.0
    """Keep the killed server down this long after its slice was fenced."""
    settle_s: float = 4.0
    """Load between the restart and the coordinator stop."""
    coordinator_outage_s: float = 4.0
    """How long the coordinator stays down."""
    catchup_timeout_s: float = 30.0
    """Give up waiting for the catch-up after this long."""
    after_s: float = 6.0
    """Load after the catch-up."""
    rate_per_s: float = 40.0
    """Requests per second during the scenario."""
    victim: int = -1
    """Index of the server to kill (-1: the last)."""

    def planned_s(self, instance_timeout_s: float) -> float:
        return (
            self.warmup_s
            + instance_timeout_s
            + 2.0
            + self.dead_hold_s
            + self.settle_s
            + self.coordinator_outage_s
            + 3.0
            + self.after_s
        )


class _Scenario:
    """The state machine run between two requests; each step records when it happened."""

    def __init__(self, fleet: Fleet, driver: NodeDriver, cfg: ChurnConfig, say: Say) -> None:
        self.fleet = fleet
        self.driver = driver
        self.cfg = cfg
        self.say = say
        self.victim = cfg.victim % len(fleet.servers)
        self.step = "warmup"
        self.marks: dict[str, float] = {}
        self.old_incarnation = 0
        self.victim_placements_at_kill = 0
        self.coordinator_exit: int | None = None
        self.delivery_at_catchup: dict[str, Any] = {}
        self._next_poll = 0.0
        self.catchup_target: dict[str, tuple[int, int]] = {}

    def now(self) -> float:
        return time.monotonic() - self.driver.t0

    def mark(self, name: str) -> float:
        t = self.now()
        self.marks[name] = round(t, 3)
        return t

    def since(self, name: str) -> float:
        return self.now() - self.marks[name]

    def __call__(self) -> None:
        now = self.now()
        if now < self._next_poll:
            return
        self._next_poll = now + 0.05
        getattr(self, f"_{self.step}")()

    def _warmup(self) -> None:
        if self.now() < self.cfg.warmup_s:
            return
        srv = self.fleet.servers[self.victim]
        self.old_incarnation = self.driver.incarnations[self.victim]
        placements = owner_placements(self.fleet.directory_stats())
        self.victim_placements_at_kill = placements.get((srv.instance_id, self.old_incarnation), 0)
        self.fleet.kill(srv)
        self.driver.disconnect(self.victim)
        self.mark("kill")
        self.say(
            f"  churn: killed {srv.instance_id} (kill -9) holding"
            f" {self.victim_placements_at_kill} directory placements"
        )
        self.step = "wait_fence"

    def _wait_fence(self) -> None:
        srv = self.fleet.servers[self.victim]
        stats = self.fleet.directory_stats()
        if stats is not None:
            left = owner_placements(stats).get((srv.instance_id, self.old_incarnation), 0)
            if left == 0:
                self.mark("fenced")
                self.say(f"  churn: {srv.instance_id}'s L1 slice fenced after"
                         f" {self.marks['fenced'] - self.marks['kill']:.2f}s")  # fmt: skip
                self.step = "dead_hold"
                return
        if self.since("kill") > self.cfg.fence_timeout_s:
            self.say(f"  churn: no fence within {self.cfg.fence_timeout_s}s")
            self.mark("fence_timeout")
            self.step = "dead_hold"

    def _dead_hold(self) -> None:
        last = self.marks.get("fenced", self.marks.get("fence_timeout", 0.0))
        if self.now() - last < self.cfg.dead_hold_s:
            return
        self.mark("restart")
        self.fleet.start_server(self.victim)
        self.driver.connect(self.victim)
        self.fleet.wait_registered([self.fleet.servers[self.victim].instance_id])
        self.mark("restarted")
        self.say(
            f"  churn: restarted {self.fleet.servers[self.victim].instance_id} as a new"
            f" incarnation in {self.marks['restarted'] - self.marks['restart']:.2f}s"
        )
        self.step = "settle"

    def _settle(self) -> None:
        if self.since("restarted") < self.cfg.settle_s:
            return
        self.mark("coordinator_stop")
        self.coordinator_exit = self.fleet.stop(self.fleet.coordinator)
        self.mark("coordinator_down")
        self.say(f"  churn: coordinator stopped (exit {self.coordinator_exit}), down for"
                 f" {self.cfg.coordinator_outage_s:.0f}s")  # fmt: skip
        self.step = "outage"

    def _outage(self) -> None:
        if self.since("coordinator_down") < self.cfg.coordinator_outage_s:
            return
        self.fleet.start_coordinator()
        self.mark("coordinator_up")
        # Catch-up target: every batch the live servers had cut when the coordinator
        # came back (the whole outage's backlog), delivered for their current incarnation.
        self.catchup_target = {}
        for k, srv in enumerate(self.fleet.servers):
            st = self.fleet.server_status(k)
            if st is not None:
                self.catchup_target[srv.instance_id] = (st.incarnation, st.events.last_seq)
        self.say("  churn: coordinator restarted from its snapshot")
        self.step = "catchup"

    def _catchup(self) -> None:
        cur = cursors(self.fleet.directory_stats())
        detail: dict[str, Any] = {}
        done = bool(self.catchup_target)
        for iid, (inc, seq) in self.catchup_target.items():
            c = cur.get(iid)
            ok = (
                c is not None
                and c.incarnation == inc
                and c.last_seq is not None
                and c.last_seq >= seq
            )
            detail[iid] = {
                "target_seq": seq,
                "directory_seq": c.last_seq if c is not None else None,
                "ok": ok,
            }
            done = done and ok
        if done:
            self.mark("caught_up")
            self.delivery_at_catchup = detail
            self.say(f"  churn: events caught up"
                     f" {self.marks['caught_up'] - self.marks['coordinator_up']:.2f}s after"
                     " the restart")  # fmt: skip
            self.step = "after"
        elif self.since("coordinator_up") > self.cfg.catchup_timeout_s:
            self.mark("catchup_timeout")
            self.delivery_at_catchup = detail
            self.say("  churn: no catch-up within the timeout")
            self.step = "after"

    def _after(self) -> None:
        last = self.marks.get("caught_up", self.marks.get("catchup_timeout", 0.0))
        if self.now() - last >= self.cfg.after_s:
            self.step = "done"

    def _done(self) -> None:
        return


WINDOWS = (
    ("before", None, "kill"),
    ("owner_dead", "kill", "fenced"),
    ("fenced", "fenced", "restarted"),
    ("restarted", "restarted", "coordinator_down"),
    ("coordinator_down", "coordinator_down", "coordinator_up"),
    ("catching_up", "coordinator_up", "caught_up"),
    ("after", "caught_up", None),
)


def window_summaries(recs: list[RequestRecord], marks: dict[str, float]) -> dict[str, Any]:
    """Hint accuracy and hit rates per scenario window."""
    out: dict[str, Any] = {}
    for name, lo_mark, hi_mark in WINDOWS:
        if (lo_mark and lo_mark not in marks) or (hi_mark and hi_mark not in marks):
            continue  # a step of the scenario that never happened
        lo = marks[lo_mark] if lo_mark else 0.0
        hi = marks[hi_mark] if hi_mark else float("inf")
        part = [r for r in recs if lo <= r.t < hi]
        out[name] = {
            "from_s": round(lo, 3),
            "to_s": round(hi, 3) if hi != float("inf") else None,
            "requests": len(part),
            "errors": sum(1 for r in part if r.error),
            "rerouted": sum(r.rerouted for r in part),
            "directory_unavailable": sum(not r.dir_ok for r in part),
            **hint_summary(part),
            "lookup_ms": percentiles([r.lookup_s for r in part if not r.error], 1000.0),
            "hit_rate": hit_summary(part)["hit_rate"],
            "peer_hit_rate": hit_summary(part)["peer_hit_rate"],
        }
    return out


def run_churn_phase(
    fcfg: FleetConfig,
    requests: list[Request],
    ccfg: ChurnConfig,
    *,
    chunk_bytes: int,
    budget_s: float,
    say: Say,
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Run the scenario on a fresh fleet; the summary and the records."""
    say(f"churn phase: {fcfg.nodes} nodes, {ccfg.rate_per_s:.0f} requests/s,"
        f" instance timeout {fcfg.instance_timeout_s}s")  # fmt: skip
    with Fleet(fcfg) as fleet:
        fleet.start(lambda m: say(f"  [churn] {m}"))
        driver = NodeDriver(fleet, chunk_bytes=chunk_bytes)
        sampler = Sampler(fleet, driver.t0, interval_s=0.25)
        scen = _Scenario(fleet, driver, ccfg, say)
        deadline = time.monotonic() + budget_s
        recs: list[RequestRecord] = []
        try:
            driver.connect_all()
            first = sampler.sample()
            sampler.start()
            pending = list(requests)
            # the scenario decides when to stop; the stream repeats if it runs out
            for _ in range(1000):
                if scen.step == "done" or time.monotonic() >= deadline or not pending:
                    break
                batch = pending[: max(1, int(ccfg.rate_per_s))]
                pending = pending[len(batch) :] or list(requests)
                recs += drive(
                    driver,
                    batch,
                    deadline=deadline,
                    say=lambda _m: None,
                    label="churn",
                    rate_per_s=ccfg.rate_per_s,
                    between=scen,
                )
        finally:
            sampler.stop()
            driver.close()
        delivered_s, delivery = wait_delivered(fleet)
        inventory = inventory_check(fleet)
        last = sampler.sample()
        lost = events_lost(fleet)
        samples = sampler.snapshot()
        m = scen.marks
        p2p = {iid: p2p_delta(first.p2p.get(iid, {}), c) for iid, c in sorted(last.p2p.items())}

        def dt(a: str, b: str) -> float | None:
            return round(m[b] - m[a], 3) if a in m and b in m else None

        summary: dict[str, Any] = {
            "victim": fleet.servers[scen.victim].instance_id,
            "victim_placements_at_kill": scen.victim_placements_at_kill,
            "marks_s": m,
            "time_to_fence_s": dt("kill", "fenced"),
            "restart_to_registered_s": dt("restart", "restarted"),
            "coordinator_exit_code": scen.coordinator_exit,
            "coordinator_outage_s": dt("coordinator_down", "coordinator_up"),
            "time_to_catch_up_s": dt("coordinator_up", "caught_up"),
            "events_lost": sum(lost.values()),
            "events_lost_by_server": lost,
            "windows": window_summaries(recs, m),
            "requests": len(recs),
            "hits": hit_summary(recs),
            "hints": hint_summary(recs),
            "p2p_counters": p2p,
            "server_stale_hint_fallbacks": sum(stale_hint_fallbacks(c) for c in p2p.values()),
            "fallbacks_by_cause": _count_fallbacks(recs),
            "heartbeat": heartbeat_summary(samples),
            "invariants": {
                **request_invariants(recs),
                "fence_happened": "fenced" in m,
                "caught_up": "caught_up" in m,
                "events_lost": sum(lost.values()),
                "events_delivered_after_s": (
                    round(delivered_s, 3) if delivered_s is not None else None
                ),
                **inventory,
            },
            "delivery": delivery,
            "delivery_at_catch_up": scen.delivery_at_catchup,
            "series": {"hits": hit_series(recs), "stale": stale_series(recs, 0.5)},
            "p2p_enabled": fleet.p2p,
            "exit_codes": fleet.close(),
        }
    return summary, recs


def _count_fallbacks(recs: list[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if r.p2p_fallback:
            out[r.p2p_fallback] = out.get(r.p2p_fallback, 0) + 1
    return dict(sorted(out.items()))
