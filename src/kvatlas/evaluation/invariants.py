"""The invariants a fleet run must keep, checked against the live processes.

Owns the end-of-run checks: wait until every live server's events are delivered (nothing
pending or buffered, the coordinator's cursor at the server's last seq), then compare the
directory with the servers (per live server, the directory's L1 placements for its current
incarnation equal the chunks it holds; no L1 placement of a dead incarnation survives),
count lost events (publisher drops, gate gaps and missing seqs), and collect the per-request
invariants (no wrong KV, no failed request). Must not: change the fleet's state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvatlas.evaluation.driver import RequestRecord
from kvatlas.evaluation.fleet import Fleet
from kvatlas.evaluation.observe import cursors, owner_placements


def delivery_state(fleet: Fleet) -> tuple[bool, dict[str, Any]]:
    """Whether every live server's events have reached the directory, and the details."""
    stats = fleet.directory_stats()
    if stats is None:
        return False, {"coordinator": "down"}
    cur = cursors(stats)
    detail: dict[str, Any] = {}
    done = True
    for k, s in enumerate(fleet.servers):
        st = fleet.server_status(k)
        if st is None:
            continue
        inc = st.incarnation
        last = st.events.last_seq
        pending = st.events.pending
        buffered = st.events.buffered_batches
        c = cur.get(s.instance_id)
        ok = (
            pending == 0
            and buffered == 0
            and c is not None
            and c.incarnation == inc
            and c.last_seq is not None
            and c.last_seq >= last
            and st.registration_state == "registered"
        )
        done = done and ok
        detail[s.instance_id] = {
            "incarnation": inc,
            "server_last_seq": last,
            "directory_last_seq": c.last_seq if c is not None else None,
            "pending": pending,
            "buffered_batches": buffered,
            "delivered": ok,
        }
    return done, detail


def wait_delivered(fleet: Fleet, timeout_s: float = 30.0) -> tuple[float | None, dict[str, Any]]:
    """Seconds until every live server's events were delivered (None: not within timeout)."""
    t0 = time.monotonic()
    detail: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout_s:
        done, detail = delivery_state(fleet)
        if done:
            return time.monotonic() - t0, detail
        time.sleep(0.1)
    return None, detail


def inventory_check(fleet: Fleet) -> dict[str, Any]:
    """Directory vs servers, once events are delivered (call after ``wait_delivered``)."""
    stats = fleet.directory_stats()
    owners = owner_placements(stats)
    cur = cursors(stats)
    per: dict[str, Any] = {}
    live_keys: set[tuple[str, int]] = set()
    match = True
    for k, s in enumerate(fleet.servers):
        st = fleet.server_status(k)
        if st is None:
            continue
        inc = st.incarnation
        live_keys.add((s.instance_id, inc))
        held = st.l1.chunks
        listed = owners.get((s.instance_id, inc), 0)
        match = match and held == listed
        per[s.instance_id] = {"server_chunks": held, "directory_placements": listed}
    orphans = {f"{i}@{n}": c for (i, n), c in owners.items() if (i, n) not in live_keys and c}
    gaps = sum(c.gaps for c in cur.values())
    missing = sum(c.missing for c in cur.values())
    return {
        "directory_matches_servers": match and not orphans,
        "per_server": per,
        "orphan_l1_placements": orphans,
        "gate_gaps": gaps,
        "gate_missing_seqs": missing,
    }


def events_lost(fleet: Fleet) -> dict[str, int]:
    """Events the live servers' publishers dropped (buffer overflow), per server."""
    out: dict[str, int] = {}
    for k, s in enumerate(fleet.servers):
        st = fleet.server_status(k)
        if st is not None:
            out[s.instance_id] = st.events.dropped_events
    return out


def request_invariants(recs: Sequence[RequestRecord]) -> dict[str, Any]:
    return {
        "wrong_kv_chunks": sum(r.wrong_kv for r in recs),
        "failed_requests": sum(1 for r in recs if r.error),
        # every chunk nobody served was recomputed and offered to the local server
        "unstored_misses": sum(
            1
            for r in recs
            if not r.error
            and r.hit_chunks < r.full_chunks
            and r.stored + r.existing + r.refused != r.full_chunks
        ),
    }
