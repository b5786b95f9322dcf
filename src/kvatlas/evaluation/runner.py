"""``kvatlas bench fleet``'s composition root: the phases, in order, into one result.

Owns the bench's configuration (``BenchConfig``, one default and docstring per field), the
order of the phases (fleet: node-local vs P2P; churn; engines, when asked), the time budget
shared between them, and the result document the report is written from. Must not: parse
arguments (``kvatlas.cli.bench`` does) or format the report (``report`` does).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvatlas.evaluation.churn import ChurnConfig, run_churn_phase
from kvatlas.evaluation.engines import run_engine_phase
from kvatlas.evaluation.fleet import FleetConfig, describe_machine
from kvatlas.evaluation.fleet_phase import run_fleet_phase
from kvatlas.evaluation.report import write_all
from kvatlas.evaluation.routing import RoutingConfig, run_routing_phase
from kvatlas.evaluation.routing_report import write_routing
from kvatlas.evaluation.workload import WorkloadConfig, generate, summarize

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything one ``kvatlas bench fleet`` run needs."""

    nodes: int = 4
    """Cache servers in the fleet."""
    requests: int = 2000
    """Requests of the fleet phase's stream (each run: node-local and P2P)."""
    duration_s: float = 480.0
    """Wall-time budget of all phases together (the run stops driving when it is spent)."""
    churn: bool = True
    """Run the churn phase."""
    engines: bool = False
    """Run the engine phase (two reference engines with SmolLM2)."""
    out: Path = Path("fleet-eval")
    """Where result.json, the plots and report.md go."""
    seed: int = 7
    """Workload seed."""
    chunk_size: int = 256
    """Tokens per chunk."""
    chunk_bytes: int = 64 * 1024
    """KV bytes per chunk in the no-engine phases."""
    l1_size_mb: float = 48.0
    """L1 per server (MiB); small enough that the workload evicts."""
    churn_rate_per_s: float = 40.0
    """Requests per second during the churn scenario."""
    p2p: bool = True
    """Use P2P when the servers support it (the fleet phase always also runs without)."""
    fleet: FleetConfig = field(default_factory=FleetConfig)
    """Process settings (heartbeat, timeouts, flush interval)."""
    churn_cfg: ChurnConfig = field(default_factory=ChurnConfig)
    """Scenario timings of the churn phase."""
    routing: RoutingConfig | None = None
    """Run the routing phase only (``--routing``), with these settings."""


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    return ""


def run_bench(
    cfg: BenchConfig, *, command: str = "", say: Say = print, write: bool = True
) -> dict[str, Any]:
    """Run the phases; return the result document (also written to ``cfg.out``)."""
    if cfg.routing is not None:
        return run_routing(cfg, cfg.routing, command=command, say=say, write=write)
    t_start = time.monotonic()
    deadline = t_start + cfg.duration_s
    fcfg = replace(
        cfg.fleet,
        nodes=cfg.nodes,
        chunk_size=cfg.chunk_size,
        l1_size_mb=cfg.l1_size_mb,
        p2p=cfg.p2p,
    )
    wcfg = WorkloadConfig(
        requests=cfg.requests, nodes=cfg.nodes, seed=cfg.seed, chunk_size=cfg.chunk_size
    )
    requests = generate(wcfg)
    result: dict[str, Any] = {
        "command": command or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": describe_machine(),
        "config": {
            **{k: v for k, v in asdict(cfg).items() if k not in {"fleet", "churn_cfg", "out"}},
            "out": str(cfg.out),
            **{k: v for k, v in asdict(fcfg).items() if k not in {"nodes", "chunk_size"}},
            "churn": asdict(cfg.churn_cfg) if cfg.churn else None,
        },
        "workload": summarize(requests, cfg.chunk_size),
    }
    phases = 1 + cfg.churn + cfg.engines
    # the fleet phase gets its share; the churn phase needs its planned time at most
    churn_need = cfg.churn_cfg.planned_s(fcfg.instance_timeout_s) + 30 if cfg.churn else 0.0
    fleet_budget = max(30.0, (cfg.duration_s - churn_need) / max(1, phases - cfg.churn))
    modes = run_fleet_phase(
        fcfg, requests, chunk_bytes=cfg.chunk_bytes, budget_s=fleet_budget, say=say
    )
    result["fleet"] = {m: r.summary for m, r in modes.items()}
    if cfg.churn:
        churn_reqs = generate(replace(wcfg, seed=cfg.seed + 1, requests=4000))
        ccfg = replace(cfg.churn_cfg, rate_per_s=cfg.churn_rate_per_s)
        summary, _ = run_churn_phase(
            fcfg,
            churn_reqs,
            ccfg,
            chunk_bytes=cfg.chunk_bytes,
            budget_s=max(20.0, min(churn_need + 30, deadline - time.monotonic())),
            say=say,
        )
        result["churn"] = summary
    if cfg.engines:
        result["engines"] = run_engine_phase(
            fcfg, seed=cfg.seed, budget_s=max(60.0, deadline - time.monotonic()), say=say
        )
    result["invariants"] = invariants(result)
    result["elapsed_s"] = round(time.monotonic() - t_start, 1)
    if write:
        paths = write_all(result, cfg.out)
        say(f"wrote {', '.join(str(p) for p in paths)}")
    return result


def run_routing(
    cfg: BenchConfig, rcfg: RoutingConfig, *, command: str, say: Say, write: bool
) -> dict[str, Any]:
    """The routing phase alone; its own report (``routing_report``)."""
    t_start = time.monotonic()
    fcfg = replace(cfg.fleet, chunk_size=cfg.chunk_size, p2p=cfg.p2p)
    result: dict[str, Any] = {
        "command": command or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": describe_machine(),
        "routing": run_routing_phase(fcfg, rcfg, say),
    }
    runs = result["routing"]["runs"].values()
    result["invariants"] = {
        "no_failed_requests": all(r.get("failed", 1) == 0 for r in runs),
        "every_run_ran": all("skipped" not in r for r in runs),
    }
    result["elapsed_s"] = round(time.monotonic() - t_start, 1)
    if write:
        paths = write_routing(result, cfg.out)
        say(f"wrote {', '.join(str(p) for p in paths)}")
    return result


def invariants(result: dict[str, Any]) -> dict[str, bool]:
    """The checks the acceptance asks for, each True when it held in every phase."""
    runs = list((result.get("fleet") or {}).values())
    churn = result.get("churn")
    all_runs = runs + ([churn] if churn else [])
    out = {
        "no_wrong_kv": all(r["invariants"]["wrong_kv_chunks"] == 0 for r in all_runs),
        "no_failed_requests": all(r["invariants"]["failed_requests"] == 0 for r in all_runs),
        "no_lost_events": all(
            r["invariants"]["events_lost"] == 0
            and r["invariants"]["gate_gaps"] == 0
            and r["invariants"]["gate_missing_seqs"] == 0
            for r in all_runs
        ),
        "misses_recomputed": all(r["invariants"]["unstored_misses"] == 0 for r in all_runs),
        "directory_matches_servers": all(
            r["invariants"]["directory_matches_servers"] for r in all_runs
        ),
    }
    if churn:
        out["fence_happened"] = bool(churn["invariants"]["fence_happened"])
        out["caught_up_after_coordinator_restart"] = bool(churn["invariants"]["caught_up"])
        # stale hints fall back: while the owner was dead the directory did name it (stale
        # hints were met) and every request of that window still completed
        dead = churn["windows"].get("owner_dead", {})
        out["stale_hints_fell_back"] = dead.get("stale", 0) > 0 and dead.get("errors", 1) == 0
    return out
