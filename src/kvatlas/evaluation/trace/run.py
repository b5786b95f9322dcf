"""``kvatlas bench trace``: one trace, the policies side by side, simulated and real.

Owns the run and its result document:

1. the simulation (``trace.simulate``) of every policy over the trace (or its window)
   at the run's nodes and capacity, the theoretical maximum and the ideal pooled LRU of
   the same total capacity among them;
2. the capacity sweep in the shape of the paper's Figure 9 (simulated);
3. a real replay (``trace.replay``) through a kvatlas fleet for each policy asked, at
   the run's capacity, and for ``global`` at each check capacity too; the simulation is
   trusted where it agrees with the real replays of ``global`` and ``local-prefix``
   (token hit rates within ``agree_within``);
4. ``result.json`` and the report (``trace.report``).

Must not: print (progress goes through ``say``).
"""

from __future__ import annotations

import logging
import math
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import httpx

from kvatlas.evaluation.fleet import describe_machine
from kvatlas.evaluation.trace.mooncake import Trace
from kvatlas.evaluation.trace.replay import (
    REPLAY_POLICIES,
    FellBehind,
    ReplayConfig,
    hit_series,
    replay,
)
from kvatlas.evaluation.trace.simulate import (
    PROFILES,
    SimConfig,
    capacity_sweep,
    simulate,
    simulate_all,
)
from kvatlas.launch.procs import ProcessError

Say = Callable[[str], None]

DEFAULT_OUT: Final = Path("docs/fleet-evaluation/trace")
PAPER: Final = {
    "source": "Qin et al., Mooncake: Trading More Storage for Less Computation (FAST'25)",
    "figure_10_global_over_local_hit_rate_up_to": 2.36,
    "figure_10_prefill_time_cut_up_to": 0.48,
    "figure_10_setup": "10 prefill nodes, 3M tokens of cache each, LLaMA3-70B on 8xA800",
    "figure_9": "a 3M-token local cache reaches under half the theoretical hit rate in most"
    " workloads; about 50M tokens (20 nodes pooled) reach it",
}


@dataclass(frozen=True, slots=True)
class TraceBenchConfig:
    """One ``kvatlas bench trace`` run."""

    nodes: int = 10
    node_capacity_tokens: int = 3_000_000
    profile: str = "llama3-70b-8xa800"
    speed: float = 1.0
    chunk_bytes: int = 16 << 10
    policies: tuple[str, ...] = tuple(REPLAY_POLICIES)
    """Policies replayed through a real fleet (the simulation runs every policy)."""
    check_capacities: tuple[int, ...] = ()
    """More capacities at which ``global`` is replayed for real, to check the simulation
    (the run's own capacity is always one check point)."""
    sweep_capacities: tuple[int, ...] = (
        250_000, 500_000, 1_000_000, 3_000_000, 10_000_000, 30_000_000, 100_000_000,
    )  # fmt: skip
    agree_within: float = 0.05
    """Hit rates of the simulation and the replay agree when this close (absolute)."""
    max_lag_s: float = 30.0
    out: Path = DEFAULT_OUT
    seed: int = 1
    real: bool = True
    """Replay through real fleets (False: the simulation alone)."""


@dataclass(slots=True)
class TraceBenchResult:
    command: str
    config: dict[str, Any]
    trace: dict[str, Any]
    machine: dict[str, str]
    commit: str
    simulated: dict[str, dict[str, Any]] = field(default_factory=dict)
    sweep: dict[str, Any] = field(default_factory=dict)
    real: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Replays that did not finish, and why (the others still count)."""
    paper: dict[str, Any] = field(default_factory=lambda: dict(PAPER))
    wall_s: float = 0.0


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def _sim_dict(r: Any) -> dict[str, Any]:
    d = asdict(r)
    d.pop("ttft_s", None)
    d["hit_rate_per_minute"] = [None if math.isnan(x) else x for x in d["hit_rate_per_minute"]]
    return d


def run_trace_bench(
    trace: Trace, cfg: TraceBenchConfig, *, command: str = "", say: Say = lambda _m: None
) -> TraceBenchResult:
    """The whole run (see the module doc); the result is also what the report shows."""
    t0 = time.monotonic()
    profile = PROFILES[cfg.profile]
    sim_cfg = SimConfig(
        nodes=cfg.nodes, capacity_tokens=cfg.node_capacity_tokens, profile=profile, seed=cfg.seed
    )
    res = TraceBenchResult(
        command=command,
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        trace={
            "source": trace.source,
            "requests": len(trace),
            "input_tokens": trace.input_tokens,
            "duration_s": trace.duration_s,
            "block_tokens": trace.block_tokens,
        },
        machine={**describe_machine(), "python": platform.python_version()},
        commit=_commit(),
    )
    say(f"simulating every policy over {len(trace)} requests ({trace.source})")
    sims = simulate_all(trace, sim_cfg, say=say)
    res.simulated = {p: _sim_dict(r) for p, r in sims.items()}
    say("capacity sweep (simulated)")
    sweep = capacity_sweep(
        trace, cfg.nodes, sorted(set(cfg.sweep_capacities)), config=sim_cfg, say=say
    )
    res.sweep = asdict(sweep)
    if cfg.real:
        # the connector logs each fallback (a miss nobody holds is one): a replay has
        # thousands; the counts are in the result
        logging.getLogger("kvatlas.connector").setLevel(logging.ERROR)
        runs: list[tuple[str, int]] = [(p, cfg.node_capacity_tokens) for p in cfg.policies]
        for cap in cfg.check_capacities:
            if cap != cfg.node_capacity_tokens:
                runs.append(("global", cap))
        for i, (policy, cap) in enumerate(runs, start=1):
            say(f"[{i}/{len(runs)}] real replay: {policy} at {cap:,} tokens per node")
            rcfg = ReplayConfig(
                policy=policy,
                nodes=cfg.nodes,
                node_capacity_tokens=cap,
                profile=profile,
                speed=cfg.speed,
                chunk_bytes=cfg.chunk_bytes,
                max_lag_s=cfg.max_lag_s,
                seed=cfg.seed,
            )
            key = policy if cap == cfg.node_capacity_tokens else f"{policy}@{cap}"
            try:
                out = replay(trace, rcfg, say=say)
            except (FellBehind, httpx.HTTPError, ProcessError) as exc:
                # one replay that breaks off does not lose the others: it is reported
                res.failed[key] = repr(exc)
                say(f"    {key}: FAILED: {exc!r}")
                continue
            summary: dict[str, Any] = dict(out.summary(trace.block_tokens))
            summary["hit_rate_per_minute"] = [h for _, h in hit_series(out.answers)]
            summary["ttft_s"] = sorted(a.ttft_s for a in out.answers)
            res.real[key] = summary
            sim_hit = simulate(trace, policy, replace(sim_cfg, capacity_tokens=cap)).hit_rate  # type: ignore[arg-type]
            real_hit = summary["token_hit_rate"]
            if policy in ("global", "local-prefix"):
                res.checks.append(
                    {
                        "policy": policy,
                        "capacity_tokens": cap,
                        "simulated_hit_rate": sim_hit,
                        "real_hit_rate": real_hit,
                        "agree": abs(sim_hit - real_hit) <= cfg.agree_within,
                    }
                )
            say(f"    {key}: real hit rate {real_hit:.1%}, simulated {sim_hit:.1%}")
    res.wall_s = time.monotonic() - t0
    return res
