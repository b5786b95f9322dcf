"""One fault of the campaign, run and judged: baseline, inject, hold, repair, wait for a
whole fleet, after; then the checks against the targets.

Owns `run_fault` and its measures: whether the fleet is whole again (every server
registered under its incarnation on every replica, its events delivered, every other
server listed as a P2P peer), the events lost (publisher drops, the event gate's gaps and
missing seqs, the directory against what each server holds), and `summarize`: the
survivors' lookups per class against their bounds, failed requests, wrong bytes, time to
recover, the timeline. Must not: print (progress goes through the campaign's ``say``).
"""

from __future__ import annotations

import time
from typing import Any

from kvatlas.evaluation.driver import RequestRecord
from kvatlas.evaluation.fault_campaign import Campaign
from kvatlas.evaluation.fault_load import (
    CLASSES,
    bound_s,
    lookup_class,
    timeline,
)
from kvatlas.evaluation.fault_steps import Fault
from kvatlas.evaluation.fleet import Fleet
from kvatlas.evaluation.invariants import inventory_check, wait_delivered
from kvatlas.evaluation.metrics import percentiles
from kvatlas.evaluation.observe import cursors
from kvatlas.runtime.coordinator_client import CoordinatorError


def whole(fleet: Fleet) -> str:
    """ "" when, on every coordinator replica, every server is registered under its
    incarnation and has its events delivered, and every server lists every other as a
    P2P peer; otherwise what is still missing."""
    statuses = [fleet.server_status(k) for k in range(len(fleet.servers))]
    ids = [s.instance_id for s in fleet.servers]
    for s, st in zip(fleet.servers, statuses, strict=True):
        if st is None:
            return f"{s.instance_id} does not answer"
        if st.registration_state != "registered":
            return f"{s.instance_id} is {st.registration_state}"
        if st.p2p_peers != sorted(i for i in ids if i != s.instance_id):
            return f"{s.instance_id} lists peers {st.p2p_peers}"
    for replica, client in zip(fleet.coordinators, fleet.replica_clients, strict=True):
        try:
            listed = client.instances()
            stats = client.directory_stats()
        except CoordinatorError:
            return f"{replica.name} does not answer"
        incarnations = {i.instance_id: i.incarnation for i in listed}
        cur = cursors(stats)
        for s, st in zip(fleet.servers, statuses, strict=True):
            assert st is not None
            iid = s.instance_id
            if incarnations.get(iid) != st.incarnation:
                return f"{replica.name} does not list {iid}@{st.incarnation}"
            c = cur.get(iid)
            if (
                c is None
                or c.incarnation != st.incarnation
                or c.last_seq is None  # hidden: the coordinator has an operator token
                or c.last_seq < st.events.last_seq
            ):
                return f"{iid}'s events have not reached {replica.name}"
    return ""


def _gate_counts(fleet: Fleet) -> tuple[int, int]:
    cur = cursors(fleet.directory_stats())
    return sum(c.gaps for c in cur.values()), sum(c.missing for c in cur.values())


def _dropped(fleet: Fleet) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for k, s in enumerate(fleet.servers):
        st = fleet.server_status(k)
        if st is not None:
            out[(s.instance_id, st.incarnation)] = st.events.dropped_events
    return out


def run_fault(c: Campaign, fault: Fault) -> dict[str, Any]:
    """Baseline, inject, hold, repair, wait for a whole fleet, after; then the checks."""
    cfg, fleet = c.cfg, c.fleet
    c.marks, c.notes, c.victim_p2p = {}, [], {}
    dropped_before = _dropped(fleet)
    gaps_before = _gate_counts(fleet)
    c.mark("start")
    c.hold(cfg.before_s)
    c.say(f"  {fault.name}: inject ({fault.title})")
    fault.inject(c)
    c.mark("inject")
    c.hold(cfg.hold_s * fault.hold_factor)
    c.mark("repair_start")
    fault.repair(c)
    c.mark("repair")
    c.say(f"  {fault.name}: repaired after {c.marks['repair'] - c.marks['inject']:.1f} s;"
          " waiting for a whole fleet")  # fmt: skip
    deadline = time.monotonic() + cfg.recover_timeout_s
    missing = whole(fleet)
    while missing and time.monotonic() < deadline:
        time.sleep(0.1)
        missing = whole(fleet)
    if missing:
        c.say(f"  {fault.name}: NOT whole after {cfg.recover_timeout_s:.0f} s: {missing}")
    else:
        c.mark("recovered")
        c.say(f"  {fault.name}: whole again {c.marks['recovered'] - c.marks['repair']:.2f} s"
              " after the repair")  # fmt: skip
    c.hold(cfg.after_s)
    c.mark("end")
    # events: with the load paused, everything cut is delivered, then compared
    for load in c.loads:
        load.pause()
    try:
        delivered_s, delivery = wait_delivered(fleet, timeout_s=20.0)
        inventory = inventory_check(fleet)
        dropped_after = _dropped(fleet)
        gaps_after = _gate_counts(fleet)
    finally:
        for load in c.loads:
            load.resume(reconnect=False)
    dropped = sum(n - dropped_before.get(key, 0) for key, n in dropped_after.items())
    # a restarted coordinator starts its counts again from zero
    gaps = [a - b if a >= b else a for a, b in zip(gaps_after, gaps_before, strict=True)]
    recs = [r for r in c.records() if c.marks["start"] <= r.t < c.marks["end"]]
    return summarize(
        c,
        fault,
        recs,
        events={
            "publisher_dropped": dropped,
            "gate_gaps": gaps[0],
            "gate_missing_seqs": gaps[1],
            "delivered_after_s": round(delivered_s, 3) if delivered_s is not None else None,
            "directory_matches_servers": bool(inventory["directory_matches_servers"]),
            "directory_mismatch": sum(
                abs(v["server_chunks"] - v["directory_placements"])
                for v in inventory["per_server"].values()
            )
            + sum(inventory["orphan_l1_placements"].values()),
            "orphan_l1_placements": inventory["orphan_l1_placements"],
            "per_server": inventory["per_server"],
            "delivery": delivery,
        },
        whole_missing=missing,
    )


def summarize(
    c: Campaign,
    fault: Fault,
    recs: list[RequestRecord],
    *,
    events: dict[str, Any],
    whole_missing: str,
) -> dict[str, Any]:
    cfg = c.cfg
    m = dict(c.marks)

    def bound(r: RequestRecord) -> float:
        return bound_s(
            r,
            target_s=cfg.target_ms / 1000,
            chunk_size=cfg.chunk_size,
            recompute_s_per_token=cfg.recompute_s_per_token,
        )

    ok = [r for r in recs if not r.error]
    over = sorted((r for r in ok if r.lookup_s > bound(r)), key=lambda r: -r.lookup_s)
    fallbacks: dict[str, int] = {}
    for r in ok:
        if r.p2p_fallback:
            fallbacks[r.p2p_fallback] = fallbacks.get(r.p2p_fallback, 0) + 1
    # Lost: what the directory does not list of what the servers hold (or lists beyond
    # it), and what a publisher dropped. The gate's gaps are reported beside: after a
    # coordinator restart without a snapshot they count seqs the old process applied.
    lost = events["publisher_dropped"] + events["directory_mismatch"]
    per_class = {
        cls: percentiles([r.lookup_s for r in ok if lookup_class(r) == cls], 1000.0)
        for cls in CLASSES
    }
    local_over = sum(1 for r in over if lookup_class(r) != "p2p")
    p2p_over = sum(1 for r in over if lookup_class(r) == "p2p")
    failed = sum(1 for r in recs if r.error)
    wrong = sum(r.wrong_kv for r in recs)
    targets = {
        "local_lookups_within_target": local_over == 0,
        "p2p_lookups_within_bound": p2p_over == 0,
        "no_failed_requests": failed == 0,
        "no_wrong_bytes": wrong == 0,
        "no_events_lost": lost == 0 and events["directory_matches_servers"],
        "recovered": not whole_missing,
    }
    return {
        "name": fault.name,
        "title": fault.title,
        "victim": (
            c.fleet.servers[c.victim].instance_id
            if fault.victim == "server"
            else f"{c.fleet.coordinator.name} (the first of {len(c.fleet.coordinators)})"
            if len(c.fleet.coordinators) > 1
            else c.fleet.coordinator.name
        ),
        "marks_s": m,
        "time_to_recover_s": (round(m["recovered"] - m["repair"], 3) if "recovered" in m else None),
        "inject_to_recovered_s": (
            round(m["recovered"] - m["inject"], 3) if "recovered" in m else None
        ),
        "not_whole": whole_missing,
        "requests": len(recs),
        "failed_requests": failed,
        "failed_examples": sorted({r.error for r in recs if r.error})[:5],
        "wrong_kv_chunks": wrong,
        "lookups_ms": per_class,
        "lookups_over_bound": {"local": local_over, "p2p": p2p_over},
        "slowest_over_bound": [
            {
                "t_s": round(r.t, 3),
                "node": r.node,
                "class": lookup_class(r),
                "ms": round(r.lookup_s * 1000, 1),
                "bound_ms": round(bound(r) * 1000, 1),
                "chunks": r.full_chunks,
                "hit": r.hit_chunks,
                "peer": r.peer_chunks,
                "fallback": r.p2p_fallback,
                "server_ms": {k: round(v, 1) for k, v in r.p2p_ms.items()},
            }
            for r in over[:8]
        ],
        "p2p_fallbacks": dict(sorted(fallbacks.items())),
        "events_lost": lost,
        "events": events,
        "notes": list(c.notes),
        "victim_p2p": dict(c.victim_p2p),
        "timeline": timeline(
            recs,
            t_from=m["start"],
            t_to=m["end"],
            target_s=cfg.target_ms / 1000,
            chunk_size=cfg.chunk_size,
            recompute_s_per_token=cfg.recompute_s_per_token,
        ),
        "targets": targets,
        "passed": all(targets.values()),
    }


def progress_line(res: dict[str, Any]) -> str:
    lk = res["lookups_ms"]
    missed = [k for k, v in res["targets"].items() if not v]
    return (
        f"  {res['name']}: {'PASS' if res['passed'] else 'FAIL (' + ', '.join(missed) + ')'};"
        f" max ms local hit {lk['local_hit']['max']:.0f}, local miss"
        f" {lk['local_miss']['max']:.0f}, P2P {lk['p2p']['max']:.0f};"
        f" failed {res['failed_requests']}, wrong chunks {res['wrong_kv_chunks']},"
        f" events lost {res['events_lost']}, recovered in {res['time_to_recover_s']} s"
    )
