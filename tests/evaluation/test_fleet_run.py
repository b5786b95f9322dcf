"""Small fleet and churn runs against real processes, asserting invariants, not timings.

The fleet run drives ~60 requests over 3 servers with P2P (when the servers have it) and
checks: no wrong KV byte anywhere, no failed request, every miss recomputed, no lost
event, and the directory equal to what the servers hold at the end. The churn run kills a
server, restarts it, stops and restarts the coordinator, and checks that the dead slice is
fenced, hints naming the dead node are stale and fall back to recompute, events are not
lost, and the directory catches up. Nothing may be left running.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvatlas.evaluation.churn import ChurnConfig, run_churn_phase
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.fleet_phase import run_mode
from kvatlas.evaluation.report import write_all
from kvatlas.evaluation.runner import invariants
from kvatlas.evaluation.workload import WorkloadConfig, generate

CHUNK = 64
CHUNK_BYTES = 16 * 1024
LENGTH_CAP_S = 300.0
"""A run's cap on its length: only a hang may reach it (a run takes a small part of it), so a
stalled shared machine slows a run down instead of cutting it short and failing it."""


def _fcfg(nodes: int) -> FleetConfig:
    return FleetConfig(nodes=nodes, chunk_size=CHUNK, l1_size_mb=2.0, engine_workers=1)


def _wcfg(requests: int, nodes: int, seed: int) -> WorkloadConfig:
    return WorkloadConfig(
        requests=requests,
        nodes=nodes,
        seed=seed,
        chunk_size=CHUNK,
        system_prompt_tokens=(70, 150),
        documents=12,
        document_chunks=(2, 5),
        chat_sessions=6,
        fresh_chunks=(1, 3),
        question_tokens=(10, 40),
        answer_tokens=(20, 80),
        max_tokens=1500,
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is not running
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_small_fleet_run_keeps_the_invariants(tmp_path: Path) -> None:
    reqs = generate(_wcfg(60, 3, seed=3))
    res = run_mode(
        "p2p",
        _fcfg(3),
        reqs,
        chunk_bytes=CHUNK_BYTES,
        deadline=time.monotonic() + LENGTH_CAP_S,
        say=lambda _m: None,
        # Back to back the 60 requests end within about one event flush interval: the
        # directory could name nothing before the stream ended. Paced, they span several.
        rate_per_s=30.0,
    )
    s = res.summary
    inv = s["invariants"]
    assert s["requests"] == 60 and s["errors"] == 0, s["error_examples"]
    assert inv["wrong_kv_chunks"] == 0
    assert inv["failed_requests"] == 0 and inv["unstored_misses"] == 0
    assert inv["events_lost"] == 0 and inv["gate_gaps"] == 0 and inv["gate_missing_seqs"] == 0
    assert inv["directory_matches_servers"], inv
    assert s["hits"]["hit_chunks"] > 0  # the stream reuses prefixes
    assert s["hints"]["hints_probed"] > 0  # the directory named other nodes
    if s["p2p_enabled"]:
        assert s["hits"]["peer_hit_rate"] > 0  # something came from a peer
    assert all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]
    # the report renders from the summary alone
    result: dict[str, Any] = {"fleet": {"p2p": s}, "machine": {}, "config": {}, "workload": {}}
    result["invariants"] = invariants(result)
    assert all(result["invariants"].values())
    paths = write_all(result, tmp_path / "out")
    assert (tmp_path / "out" / "report.md").read_text().startswith("# kvatlas fleet evaluation")
    assert any(p.suffix == ".png" for p in paths)


@pytest.mark.slow
def test_small_churn_run_fences_falls_back_and_loses_nothing() -> None:
    reqs = generate(_wcfg(400, 3, seed=4))
    ccfg = ChurnConfig(
        warmup_s=2.0,
        dead_hold_s=0.5,
        settle_s=1.5,
        coordinator_outage_s=2.0,
        after_s=1.5,
        rate_per_s=30.0,
    )
    s, _recs = run_churn_phase(
        _fcfg(3), reqs, ccfg, chunk_bytes=CHUNK_BYTES, budget_s=LENGTH_CAP_S, say=lambda _m: None
    )
    inv = s["invariants"]
    assert inv["fence_happened"], s["marks_s"]
    assert inv["caught_up"], s["delivery_at_catch_up"]
    assert inv["wrong_kv_chunks"] == 0
    assert inv["failed_requests"] == 0 and inv["unstored_misses"] == 0
    assert s["events_lost"] == 0 and inv["gate_gaps"] == 0 and inv["gate_missing_seqs"] == 0
    assert inv["directory_matches_servers"], inv
    assert not inv["orphan_l1_placements"]  # the old incarnation's slice is gone
    # requests that met hints naming the dead node completed: stale hints fell back
    dead = s["windows"]["owner_dead"]
    assert dead["hints_probed"] > 0, "no request met a hint naming the dead node"
    assert dead["stale"] > 0 and dead["errors"] == 0
    assert s["windows"]["coordinator_down"]["errors"] == 0
    assert s["exit_codes"]["coordinator"] == 0


def test_fleet_close_stops_every_process_it_started() -> None:
    fleet = Fleet(_fcfg(2))
    try:
        fleet.start()
        pids = [p.pid for p in (fleet.coordinator, *fleet.servers)]
        fleet.kill(fleet.servers[0])
    finally:
        fleet.close()
    assert all(pid is not None and not _pid_alive(pid) for pid in pids)
    assert not fleet.workdir.exists()
