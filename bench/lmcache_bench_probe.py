"""`lmcache bench server`, run in-process by .venv-lmcache's Python and watched.

Runs LMCache's own server benchmark exactly as its CLI does (`lmcache.cli.main.main`
with the same argv: the same parser, the same `run_server_bench`, the same
`BaselineBenchCase` and `ServerBenchClient`), and records besides what the CLI prints:

- every latency list the case collected (the CLI's summary leaves out `cold.retrieve`);
- the checks the case made (cold full miss, warm full hit, transfers succeeded, checksum
  match), as passed / failed counts;
- per LOOKUP / STORE / RETRIEVE call: its wall time, the tokens it moved (a lookup: the
  tokens it found; a failed transfer: 0), and the client's own cost, the CPU time (all
  threads of this process) spent inside the call and the minor page faults it took;
- engine-driven, the wall time of each of the transfer context's calls to the server
  (``prepare_store`` / ``commit_store``, ``prepare_retrieve`` / ``commit_retrieve``, each
  a round trip), so that a store's or retrieve's latency splits into the server's part and
  the worker's own gather or scatter in between;
- the load phase's wall time and the CPU time this process and the server's process tree
  (``--server-pid`` and its descendants, from /proc) used during it; the one-time startup
  (torch import, KV allocation, registration) is outside that window.

Nothing of LMCache is changed: the methods are wrapped, and the wrappers call through.

    .venv-lmcache/bin/python bench/lmcache_bench_probe.py --server-pid PID --out FILE \
        -- bench server --rpc-url tcp://127.0.0.1:6555 --mode cpu ...

Not part of the kvatlas package: it imports lmcache, which only .venv-lmcache has.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcache.cli.commands.bench.server_bench.cases.base import BenchResult
from lmcache.cli.commands.bench.server_bench.cases.baseline import BaselineBenchCase
from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.main import main as lmcache_main
from lmcache.v1.multiprocess.transfer_context.shm import EngineDrivenContextShm

TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (0 if gone)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = (task / "children").read_text().split()
                todo.extend(int(k) for k in kids)
        except (OSError, ValueError, IndexError):
            continue
    return total


class Watch:
    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.op_cpu_ms: dict[str, list[float]] = {}
        self.op_wall_ms: dict[str, list[float]] = {}
        self.op_tokens: dict[str, list[int]] = {}
        self.op_minor_faults: dict[str, list[int]] = {}
        self.call_wall_ms: dict[str, list[float]] = {}
        self.load: dict[str, float] = {}
        self.result: BenchResult | None = None

    def wrap_op(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(client: ServerBenchClient, request: Any, *args: Any, **kw: Any) -> Any:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, w0 = time.process_time(), time.perf_counter()
            out = fn(client, request, *args, **kw)
            c1, w1 = time.process_time(), time.perf_counter()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if out is not None:  # an empty range is not a transfer
                key = f"{request.request_kind}.{name}"
                self.op_cpu_ms.setdefault(key, []).append((c1 - c0) * 1e3)
                self.op_wall_ms.setdefault(key, []).append((w1 - w0) * 1e3)
                self.op_minor_faults.setdefault(key, []).append(f1 - f0)
                ok = out.succeeded
                # a transfer's tokens; a lookup's: the tokens it found
                tokens = (
                    out.token_count if name != "lookup" else out.hit_chunks * request.chunk_size
                )
                self.op_tokens.setdefault(key, []).append(tokens if ok else 0)
            return out

        return wrapped

    def wrap_call(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kw: Any) -> Any:
            w0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.call_wall_ms.setdefault(name, []).append((time.perf_counter() - w0) * 1e3)

        return wrapped

    def wrap_run(self, fn: Callable[..., BenchResult]) -> Callable[..., BenchResult]:
        def wrapped(case: BaselineBenchCase, client: ServerBenchClient, log: Any) -> BenchResult:
            s0, c0, w0 = tree_cpu_s(self.server_pid), time.process_time(), time.perf_counter()
            result = fn(case, client, log)
            w1, c1, s1 = time.perf_counter(), time.process_time(), tree_cpu_s(self.server_pid)
            self.load = {"wall_s": w1 - w0, "client_cpu_s": c1 - c0, "server_cpu_s": s1 - s0}
            self.result = result
            return result

        return wrapped

    def report(self) -> dict[str, Any]:
        r = self.result
        checks = (
            {}
            if r is None
            else {
                name: {"passed": r.passed_count(name), "failed": r.failed_count(name)}
                for name in r.checks
            }
        )
        return {
            "completed": r is not None and not r.interrupted,
            "completed_runs": r.completed_runs if r else 0,
            "latencies_ms": r.latencies_ms if r else {},
            "checks": checks,
            "op_cpu_ms": self.op_cpu_ms,
            "op_wall_ms": self.op_wall_ms,
            "op_tokens": self.op_tokens,
            "op_minor_faults": self.op_minor_faults,
            "call_wall_ms": self.call_wall_ms,
            "load": self.load,
        }


def main() -> int:
    ap = argparse.ArgumentParser(prog="lmcache_bench_probe.py")
    ap.add_argument("--server-pid", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("lmcache_argv", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    argv = [a for a in args.lmcache_argv if a != "--"]
    watch = Watch(args.server_pid)
    BaselineBenchCase.run = watch.wrap_run(BaselineBenchCase.run)
    for op in ("lookup", "store", "retrieve"):
        setattr(ServerBenchClient, op, watch.wrap_op(op, getattr(ServerBenchClient, op)))
    for call in ("prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve"):
        fn = getattr(EngineDrivenContextShm, call)
        setattr(EngineDrivenContextShm, call, watch.wrap_call(call, fn))
    code, error = 0, ""
    try:
        lmcache_main(argv)
    except SystemExit as exc:  # the CLI exits 1 on a failed start (server not answering)
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # reported to the harness, which names the target
        code, error = 1, f"{type(exc).__name__}: {exc}"
    report = watch.report()
    report["exit_code"] = code
    report["error"] = error
    args.out.write_text(json.dumps(report))
    return code


if __name__ == "__main__":
    sys.exit(main())
