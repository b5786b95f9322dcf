"""The fleet phase: the workload on a live fleet, node-local only and with P2P, side by side.

Owns one run of the request stream against a fresh fleet (``run_mode``) and the phase that
runs it twice: servers without P2P (node-local reuse only) and with P2P (fleet-wide reuse).
Must not: print; progress goes through the ``say`` callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvatlas.evaluation.driver import NodeDriver, RequestRecord
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.invariants import (
    events_lost,
    inventory_check,
    request_invariants,
    wait_delivered,
)
from kvatlas.evaluation.metrics import (
    heartbeat_summary,
    hit_series,
    p2p_delta,
    run_summary,
    stale_series,
)
from kvatlas.evaluation.observe import Sampler
from kvatlas.evaluation.workload import Request

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One run of the stream: its summary (JSON-able) and the raw records for plots."""

    mode: str
    summary: dict[str, Any]
    records: list[RequestRecord]


def drive(
    driver: NodeDriver,
    requests: list[Request],
    *,
    deadline: float,
    say: Say,
    label: str,
    rate_per_s: float = 0.0,
    between: Callable[[], None] | None = None,
) -> list[RequestRecord]:
    """Run ``requests`` in order until done or ``deadline`` (monotonic); progress every 10%."""
    recs: list[RequestRecord] = []
    step = max(1, len(requests) // 10)
    start = time.monotonic()
    for n, req in enumerate(requests):
        if time.monotonic() >= deadline:
            say(f"  {label}: time budget reached after {n} requests")
            break
        if rate_per_s > 0:
            wait = start + n / rate_per_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        if between is not None:
            between()
        recs.append(driver.run(req))
        if (n + 1) % step == 0:
            done = recs[-step:]
            full = sum(r.full_chunks for r in done) or 1
            say(
                f"  {label}: {n + 1}/{len(requests)} requests,"
                f" hit rate {sum(r.hit_chunks for r in done) / full:.0%} (last {len(done)}),"
                f" errors {sum(1 for r in recs if r.error)}"
            )
    return recs


def run_mode(
    mode: str,
    fcfg: FleetConfig,
    requests: list[Request],
    *,
    chunk_bytes: int,
    deadline: float,
    say: Say,
    rate_per_s: float = 0.0,
) -> ModeResult:
    """Start a fleet (P2P as ``fcfg.p2p``), drive the stream, check the invariants, stop.

    ``rate_per_s``: requests start at most this often (0: back to back). Back to back, a
    short stream can end inside one event flush interval, before the directory names
    anything; a real engine's prefill spaces requests out."""
    with Fleet(fcfg) as fleet:
        fleet.start(lambda m: say(f"  [{mode}] {m}"))
        driver = NodeDriver(fleet, chunk_bytes=chunk_bytes)
        sampler = Sampler(fleet, driver.t0)
        try:
            driver.connect_all()
            first = sampler.sample()
            sampler.start()
            recs = drive(
                driver, requests, deadline=deadline, say=say, label=mode, rate_per_s=rate_per_s
            )
        finally:
            sampler.stop()
            driver.close()
        delivered_s, delivery = wait_delivered(fleet)
        inventory = inventory_check(fleet)
        last = sampler.sample()
        summary = run_summary(recs, chunk_bytes)
        summary.update(
            mode=mode,
            p2p_enabled=fleet.p2p,
            heartbeat=heartbeat_summary(sampler.snapshot()),
            p2p_counters={
                iid: p2p_delta(first.p2p.get(iid, {}), c) for iid, c in sorted(last.p2p.items())
            },
            invariants={
                **request_invariants(recs),
                "events_lost": sum(events_lost(fleet).values()),
                "events_delivered_after_s": (
                    round(delivered_s, 3) if delivered_s is not None else None
                ),
                **inventory,
            },
            delivery=delivery,
            series={"hits": hit_series(recs), "stale": stale_series(recs)},
        )
        exit_codes = fleet.close()
        summary["exit_codes"] = exit_codes
    return ModeResult(mode, summary, recs)


def run_fleet_phase(
    fcfg: FleetConfig,
    requests: list[Request],
    *,
    chunk_bytes: int,
    budget_s: float,
    say: Say,
) -> dict[str, ModeResult]:
    """Node-local (P2P off) then fleet-wide (P2P on, when available) on the same stream."""
    out: dict[str, ModeResult] = {}
    t_end = time.monotonic() + budget_s
    modes = [("local", False)]
    if fcfg.p2p:
        modes.append(("p2p", True))
    for i, (mode, p2p) in enumerate(modes):
        share = (t_end - time.monotonic()) / (len(modes) - i)
        say(f"fleet phase, {mode} run: {len(requests)} requests on {fcfg.nodes} nodes")
        res = run_mode(
            mode,
            replace(fcfg, p2p=p2p),
            requests,
            chunk_bytes=chunk_bytes,
            deadline=time.monotonic() + share,
            say=say,
        )
        out[mode] = res
    return out
