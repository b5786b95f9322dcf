"""``kvatlas bench trace``: flags -> a ``TraceBenchConfig`` -> the run and its report.

The one place where the trace benchmark's flags are read. A flag's bad value is a usage
error naming it (exit 2). Progress lines go to stdout while it runs.

The benchmarks run on a ``kvatlas[bench]`` install: a package they need that is not
installed stops a run before it starts (``runtime.extras``), with a message naming the
extra that installs it, never a traceback after the run.

    kvatlas bench trace --nodes 10 --node-capacity-tokens 3000000 --speed 2
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from kvatlas.core.errors import InvalidInput
from kvatlas.evaluation.trace.mooncake import (
    DEFAULT_BLOCK_TOKENS,
    bundled_trace_path,
    load_trace,
)
from kvatlas.evaluation.trace.replay import REPLAY_POLICIES
from kvatlas.evaluation.trace.run import TraceBenchConfig, run_trace_bench
from kvatlas.evaluation.trace.simulate import PROFILES
from kvatlas.runtime.extras import needs_extra


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"{flag} takes comma-separated whole numbers, got {text!r}") from exc
    if any(x <= 0 for x in out):
        raise ValueError(f"{flag} values must be positive, got {text!r}")
    return out


def build_trace_parser() -> argparse.ArgumentParser:
    d = TraceBenchConfig()
    ap = argparse.ArgumentParser(
        prog="kvatlas bench trace",
        description="Replay a trace in Mooncake's format (timestamp ms, input_length,"
        " output_length, hash_ids) through real kvatlas fleets, one per policy (local caches"
        " routed at random, by load or by local prefix; the global cache: kvatlas P2P with"
        " kv-p2p routing), beside a simulation of the same policies, the ideal pooled LRU,"
        " the theoretical maximum and a capacity sweep; writes a report with plots.",
    )
    ap.add_argument(
        "--trace",
        default=str(bundled_trace_path()),
        help="trace file, JSON lines (default: the vendored FAST'25 conversation trace)",
    )
    ap.add_argument(
        "--trace-block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS,
        help=f"tokens each hash id stands for (default {DEFAULT_BLOCK_TOKENS})",
    )  # fmt: skip
    ap.add_argument(
        "--window-start-s", type=float, default=0.0,
        help="replay the trace from this second of it (default 0)",
    )  # fmt: skip
    ap.add_argument(
        "--window-s", type=float, default=0.0,
        help="replay this many seconds of the trace (default 0: all of it)",
    )  # fmt: skip
    ap.add_argument("--nodes", type=int, default=d.nodes, help=f"nodes (default {d.nodes})")
    ap.add_argument(
        "--node-capacity-tokens", type=int, default=d.node_capacity_tokens,
        help=f"cache tokens per node (default {d.node_capacity_tokens:,})",
    )  # fmt: skip
    ap.add_argument(
        "--profile", default=d.profile, choices=sorted(PROFILES),
        help=f"prefill cost model (default {d.profile})",
    )  # fmt: skip
    ap.add_argument(
        "--speed", type=float, default=d.speed,
        help="trace seconds per wall second in the real replays (default 1)",
    )  # fmt: skip
    ap.add_argument(
        "--chunk-bytes", type=int, default=d.chunk_bytes,
        help=f"KV bytes per block in the real replays (default {d.chunk_bytes})",
    )  # fmt: skip
    ap.add_argument(
        "--policies", default=",".join(d.policies),
        help="policies replayed through a real fleet (the simulation runs them all)",
    )  # fmt: skip
    ap.add_argument(
        "--check-capacities", default="",
        help="more tokens-per-node values at which global is replayed for real, to check"
        " the simulation (comma-separated)",
    )  # fmt: skip
    ap.add_argument(
        "--sweep-capacities", default=",".join(str(c) for c in d.sweep_capacities),
        help="tokens-per-node values of the simulated capacity sweep",
    )  # fmt: skip
    ap.add_argument(
        "--max-lag-s", type=float, default=d.max_lag_s,
        help="fail when the fleet falls this many seconds behind the trace's clock",
    )  # fmt: skip
    ap.add_argument(
        "--simulate-only", action="store_true", help="no real replays: the simulation alone"
    )
    ap.add_argument("--out", default=str(d.out), help=f"report folder (default {d.out})")
    ap.add_argument("--seed", type=int, default=d.seed, help="seed of random routing")
    return ap


def trace_config_from_args(args: argparse.Namespace) -> TraceBenchConfig:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = [p for p in policies if p not in REPLAY_POLICIES]
    if unknown:
        raise ValueError(f"--policies: unknown {unknown}; choose from {','.join(REPLAY_POLICIES)}")
    for flag, value in (
        ("--nodes", args.nodes),
        ("--node-capacity-tokens", args.node_capacity_tokens),
        ("--trace-block-tokens", args.trace_block_tokens),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be positive, got {value}")
    if not args.speed > 0 or not args.max_lag_s > 0:
        raise ValueError("--speed and --max-lag-s must be positive")
    if args.window_start_s < 0 or args.window_s < 0:
        raise ValueError("--window-start-s and --window-s must not be negative")
    return TraceBenchConfig(
        nodes=args.nodes,
        node_capacity_tokens=args.node_capacity_tokens,
        profile=args.profile,
        speed=args.speed,
        chunk_bytes=args.chunk_bytes,
        policies=policies,
        check_capacities=_ints(args.check_capacities, "--check-capacities"),
        sweep_capacities=_ints(args.sweep_capacities, "--sweep-capacities"),
        max_lag_s=args.max_lag_s,
        out=Path(args.out),
        seed=args.seed,
        real=not args.simulate_only,
    )


def main(argv: list[str]) -> int:
    """``argv``: the flags after ``kvatlas bench trace``."""
    ap = build_trace_parser()
    args = ap.parse_args(argv)
    try:
        cfg = trace_config_from_args(args)
        trace = load_trace(args.trace, block_tokens=args.trace_block_tokens)
        if args.window_s:
            trace = trace.window(args.window_start_s, args.window_s)
    except (ValueError, InvalidInput) as exc:
        ap.error(str(exc))
    with needs_extra("bench", "kvatlas bench trace's report"):
        # matplotlib, the bench extra: imported here, before the run, so that a missing
        # one stops the command at once rather than after the replays.
        from kvatlas.evaluation.trace.report import write_trace_report  # noqa: PLC0415
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    command = shlex.join(["kvatlas", "bench", "trace", *argv])
    try:
        result = run_trace_bench(trace, cfg, command=command, say=say)
    except KeyboardInterrupt:
        say("interrupted: every process of the run was stopped")
        return 130
    write_trace_report(result, cfg.out)
    bad = [c for c in result.checks if not c["agree"]]
    say(f"report: {cfg.out / 'report.md'}")
    if bad:
        say(f"simulation and replay disagree at {len(bad)} check point(s): see the report")
    for key, why in result.failed.items():
        say(f"FAILED: the replay {key} did not finish: {why}")
    return 1 if result.failed else 0
