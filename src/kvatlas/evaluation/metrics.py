"""Numbers from what a run recorded: hit rates, hint accuracy, latencies, time series.

Owns the arithmetic from ``RequestRecord``s and ``Sample``s to the JSON-able summaries the
report prints. Pure: no I/O, no clocks.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvatlas.evaluation.driver import RequestRecord
from kvatlas.evaluation.observe import Sample


def percentiles(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, p50, p90, p99 and max of ``values`` times ``scale`` (zeros when empty)."""
    if not values:
        return {"n": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {
        "n": len(a),
        "mean": round(float(a.mean()), 4),
        "p50": round(float(np.percentile(a, 50)), 4),
        "p90": round(float(np.percentile(a, 90)), 4),
        "p99": round(float(np.percentile(a, 99)), 4),
        "max": round(float(a.max()), 4),
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else 0.0


def hit_summary(recs: Sequence[RequestRecord]) -> dict[str, Any]:
    """Chunk-weighted hit rates: of all full chunks asked for, the share served by cache."""
    ok = [r for r in recs if not r.error]
    full = sum(r.full_chunks for r in ok)
    hit = sum(r.hit_chunks for r in ok)
    peer = sum(r.peer_chunks for r in ok)
    reach = sum(max(r.dir_chunks, r.hit_chunks) for r in ok)
    return {
        "full_chunks": full,
        "hit_chunks": hit,
        "hit_rate": _ratio(hit, full),
        "local_hit_rate": _ratio(hit - peer, full),
        "peer_hit_rate": _ratio(peer, full),
        "directory_reach_rate": _ratio(reach, full),
        "recomputed_chunks": full - hit,
    }


def hint_summary(recs: Sequence[RequestRecord]) -> dict[str, Any]:
    hints = sum(r.hints for r in recs)
    stale = sum(r.stale_hints for r in recs)
    return {
        "hints_probed": hints,
        "confirmed": hints - stale,
        "stale": stale,
        "stale_ratio": _ratio(stale, hints),
    }


def run_summary(recs: Sequence[RequestRecord], chunk_bytes: int) -> dict[str, Any]:
    """Everything the report says about one run of the workload."""
    ok = [r for r in recs if not r.error]
    kinds: dict[str, Any] = {}
    for kind in sorted({r.kind for r in recs}):
        kinds[kind] = hit_summary([r for r in recs if r.kind == kind])
    fallbacks = Counter(r.p2p_fallback for r in ok if r.p2p_fallback)
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "error_examples": sorted({r.error for r in recs if r.error})[:5],
        "rerouted": sum(r.rerouted for r in recs),
        "directory_unavailable": sum(not r.dir_ok for r in recs),
        "wrong_kv_chunks": sum(r.wrong_kv for r in recs),
        "hits": hit_summary(recs),
        "hits_by_kind": kinds,
        "hints": hint_summary(recs),
        "lookup_ms": percentiles([r.lookup_s for r in ok], 1000.0),
        "directory_lookup_ms": percentiles([r.dir_lookup_s for r in recs if r.dir_ok], 1000.0),
        "peer_bytes_read": sum(r.peer_chunks for r in ok) * chunk_bytes,
        "fallbacks_by_cause": dict(sorted(fallbacks.items())),
        "stored_chunks": sum(r.stored for r in ok),
        "refused_chunks": sum(r.refused for r in ok),
        "duration_s": round(recs[-1].t - recs[0].t, 3) if recs else 0.0,
    }


def hit_series(recs: Sequence[RequestRecord], buckets: int = 30) -> dict[str, list[float]]:
    """Hit rates over time: ``buckets`` equal slices of the run by request start time."""
    ok = [r for r in recs if not r.error]
    if not ok:
        return {"t": [], "requests": [], "hit_rate": [], "local_hit_rate": [], "reach_rate": []}
    t_end = max(r.t for r in ok) + 1e-9
    edges = np.linspace(0.0, t_end, buckets + 1)
    out: dict[str, list[float]] = {
        "t": [],
        "requests": [],
        "hit_rate": [],
        "local_hit_rate": [],
        "reach_rate": [],
    }
    for lo, hi in itertools.pairwise(edges):
        part = [r for r in ok if lo <= r.t < hi]
        full = sum(r.full_chunks for r in part)
        if not full:
            continue
        out["t"].append(round(float(hi), 3))
        out["requests"].append(float(sum(1 for r in ok if r.t < hi)))
        out["hit_rate"].append(_ratio(sum(r.hit_chunks for r in part), full))
        out["local_hit_rate"].append(_ratio(sum(r.local_chunks for r in part), full))
        out["reach_rate"].append(_ratio(sum(max(r.dir_chunks, r.hit_chunks) for r in part), full))
    return out


def stale_series(recs: Sequence[RequestRecord], width_s: float = 1.0) -> dict[str, list[float]]:
    """Stale-hint ratio per ``width_s`` window (windows without probed hints are skipped)."""
    out: dict[str, list[float]] = {"t": [], "stale_ratio": [], "hints": []}
    if not recs:
        return out
    n = int(max(r.t for r in recs) / width_s) + 1
    for w in range(n):
        part = [r for r in recs if w * width_s <= r.t < (w + 1) * width_s]
        hints = sum(r.hints for r in part)
        if hints:
            out["t"].append(round((w + 0.5) * width_s, 3))
            out["stale_ratio"].append(_ratio(sum(r.stale_hints for r in part), hints))
            out["hints"].append(float(hints))
    return out


def heartbeat_summary(samples: Sequence[Sample]) -> dict[str, Any]:
    ages = [a for s in samples for a in s.heartbeat_ages.values()]
    per: dict[str, list[float]] = {}
    for s in samples:
        for iid, a in s.heartbeat_ages.items():
            per.setdefault(iid, []).append(a)
    return {
        "all_s": percentiles(ages),
        "per_instance_max_s": {k: round(max(v), 3) for k, v in sorted(per.items())},
        "samples": len(samples),
    }


def p2p_delta(first: dict[str, float], last: dict[str, float]) -> dict[str, float]:
    """Counter increase between two flattened status snapshots (new keys count from 0)."""
    return {k: round(v - first.get(k, 0.0), 3) for k, v in sorted(last.items())}
