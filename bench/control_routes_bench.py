"""The operator routes, kvatlas' coordinator beside LMCache 0.5.6's: quota set and get,
pin add and list, prefetch submit and poll, delete.

Run: `python -m bench.control_routes_bench [--rounds 5] [--requests 400] [--seconds 2]`.

Both coordinators run as their own processes on 127.0.0.1 (kvatlas' CLI; `lmcache
coordinator` from .venv-lmcache, which scripts/lmcache_env.sh builds), each with its
defaults. Prefetch and delete go through the coordinator to an MP server: one `lmcache
server` (CPU, 64 MiB L1, no L2) with the stand-in engine of the compatibility suite
(tests/lmcache/lmcache_driver.py) holding its KV layout, registered with both
coordinators under the same id, so both forward to the very same server. The client is
one keep-alive connection with a blocking socket sending pre-encoded requests one at a
time (`coordinator_bench.BlockingConn`): latency is the client's, sequential throughput
is requests over the busy time. Each route runs at most ``--requests`` requests or
``--seconds``, whichever comes first, in each of ``--rounds`` rounds, the two
coordinators in turn; the table gives the medians of the rounds' p50, p99 and
throughput. A prefetch's poll is timed for every poll until its job completes (the first
poll that sees it completed drops it). Prints a markdown table; writes JSON to
bench/results/control_routes.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from bench import machine
from bench.coordinator_bench import RESULTS
from bench.coordinator_load import pct
from bench.coordinator_procs import LMCacheCoordinator, Server
from bench.http_conns import BlockingConn
from bench.lmcache_side import LMCACHE_VENV, ROOT, lmcache_env
from kvatlas.launch.procs import HOST, ProcessError, free_port, launch

CHUNK = 256
MODEL = "test-model"
"""The model the stand-in engine registers its KV layout under."""
DRIVER = ROOT / "tests" / "lmcache" / "lmcache_driver.py"
TARGET = "bench-target"
PIN_CHUNKS = 4


class MPServer:
    """`lmcache server` and the engine that registers its layout; stopped by pid."""

    def __init__(self) -> None:
        rpc_port, self.http_port = free_port(), free_port()
        argv = [
            str(LMCACHE_VENV / "bin" / "lmcache"), "server", "--instance-id", TARGET,
            "--host", HOST, "--port", str(rpc_port), "--http-host", HOST,
            "--http-port", str(self.http_port), "--chunk-size", str(CHUNK),
            "--l1-size-gb", "0.0625", "--no-l1-use-lazy", "--eviction-policy", "LRU",
        ]  # fmt: skip
        self.proc = launch(
            argv,
            name="lmcache-server",
            env=lmcache_env(),
            http_port=self.http_port,
            http_path="/healthcheck",
            timeout=120,
        )
        self.engine = launch(
            [
                str(LMCACHE_VENV / "bin" / "python"),
                str(DRIVER),
                f"tcp://{HOST}:{rpc_port}",
                f"http://{HOST}:{self.http_port}",
            ],
            name="lmcache-engine",
            log=self.proc.log,
            env=lmcache_env(),
            pipes=True,
        )
        stdout = self.engine.popen.stdout
        assert stdout is not None
        if not stdout.readline():  # once its KV layout is registered
            self.stop()
            raise RuntimeError(f"the stand-in engine exited; see {self.proc.log}")

    def stop(self) -> None:
        stdin = self.engine.popen.stdin
        if self.engine.alive() and stdin is not None:
            stdin.write('{"op": "quit"}\n')
            stdin.close()
            with contextlib.suppress(ProcessError):
                self.engine.wait_exit(20)
        self.engine.stop()
        self.proc.stop(signal.SIGINT, grace_s=30.0)  # LMCache's server stops cleanly on SIGINT
        self.proc.log.unlink(missing_ok=True)


def request(method: str, path: str, obj: Any = None) -> bytes:
    body = b"" if obj is None else json.dumps(obj).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def _tokens(chunks: int, first: int = 1) -> list[int]:
    return list(range(first, first + chunks * CHUNK + 1))


def requests() -> dict[str, bytes]:
    """Every timed request, encoded once."""
    pin = {"model_name": MODEL, "world_size": 1, "token_ids": _tokens(PIN_CHUNKS)}
    fetch = {
        "instance_id": TARGET,
        "model_name": MODEL,
        "world_size": 1,
        "token_ids": _tokens(2, 10**6),
    }
    return {
        "quota set": request("PUT", "/quota/bench", {"limit_gb": 1.5}),
        "quota get": request("GET", "/quota/bench"),
        "pin add": request("POST", "/cache/pins", pin),
        "pin list": request("GET", f"/cache/pins?model_name={MODEL}&limit=100"),
        "prefetch submit": request("POST", "/cache/prefetches", fetch),
        "delete": request("POST", "/cache/delete", {**fetch, "tier": "l1"}),
    }


def _timed(
    conn: BlockingConn, req: bytes, n: int, seconds: float, check: Callable[[int, bytes], None]
) -> dict[str, float]:
    lat: list[float] = []
    t_end = time.perf_counter() + seconds
    while len(lat) < n and time.perf_counter() < t_end:
        t0 = time.perf_counter()
        status, data = conn.send(req)
        lat.append(time.perf_counter() - t0)
        check(status, data)
    return _summary(lat)


def _summary(lat: list[float]) -> dict[str, float]:
    """Count, median and p99 latency (ms) and the rate of one route's timed calls."""
    return {
        "n": len(lat),
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "per_s": len(lat) / sum(lat),
    }


def _ok(status: int, data: bytes) -> None:
    if status >= 300:
        raise RuntimeError(f"answered {status}: {data[:200]!r}")


def _prefetch(conn: BlockingConn, submit: bytes, n: int, seconds: float) -> dict[str, Any]:
    """Submit, then poll until completed, ``n`` times: both timed apart."""
    sub: list[float] = []
    poll: list[float] = []
    t_end = time.perf_counter() + seconds
    while len(sub) < n and time.perf_counter() < t_end:
        t0 = time.perf_counter()
        status, data = conn.send(submit)
        sub.append(time.perf_counter() - t0)
        _ok(status, data)
        rid = json.loads(data)["request_id"]
        req = request("GET", f"/cache/prefetches/{TARGET}/{rid}")
        for _ in range(1000):
            t0 = time.perf_counter()
            status, data = conn.send(req)
            poll.append(time.perf_counter() - t0)
            _ok(status, data)
            if json.loads(data)["status"] == "completed":
                break
    return {"prefetch submit": _summary(sub), "prefetch poll": _summary(poll)}


def _round(port: int, n: int, seconds: float) -> dict[str, dict[str, float]]:
    reqs = requests()
    conn = BlockingConn(port)
    try:
        out: dict[str, dict[str, float]] = {}
        for name in ("quota set", "quota get", "pin add", "pin list", "delete"):
            out[name] = _timed(conn, reqs[name], n, seconds, _ok)
        out.update(_prefetch(conn, reqs["prefetch submit"], max(1, n // 4), seconds))
        return out
    finally:
        conn.close()


ROUTES = (
    "quota set",
    "quota get",
    "pin add",
    "pin list",
    "prefetch submit",
    "prefetch poll",
    "delete",
)


def _medians(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        route: {
            stat: statistics.median(r[route][stat] for r in rounds)
            for stat in ("p50_ms", "p99_ms", "per_s", "n")
        }
        for route in ROUTES
    }


def table(med: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        "| route | kvatlas p50 / p99 ms | kvatlas req/s | LMCache p50 / p99 ms | LMCache req/s |",
        "|---|---|---|---|---|",
    ]
    for route in ROUTES:
        k, m = med["kvatlas"][route], med["lmcache"][route]
        lines.append(
            f"| {route} | {k['p50_ms']:.3f} / {k['p99_ms']:.3f} | {k['per_s']:,.0f} "
            f"| {m['p50_ms']:.3f} / {m['p99_ms']:.3f} | {m['per_s']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.control_routes_bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400, help="requests per route a round")
    ap.add_argument("--seconds", type=float, default=2.0, help="most time per route a round")
    args = ap.parse_args(argv)
    if not LMCacheCoordinator.available():
        print("skipped: no .venv-lmcache (scripts/lmcache_env.sh builds it)")
        return 0
    target = MPServer()
    kv = Server("--log-level", "WARNING")
    lm = LMCacheCoordinator()
    ports = {"kvatlas": kv.port, "lmcache": lm.port}
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {"kvatlas": [], "lmcache": []}
    try:
        for port in ports.values():
            r = httpx.post(
                f"http://127.0.0.1:{port}/instances",
                timeout=10,
                json={"instance_id": TARGET, "ip": "127.0.0.1", "http_port": target.http_port},
            )
            r.raise_for_status()
        for i in range(args.rounds):
            for name, port in ports.items():
                print(f"[bench] round {i + 1}/{args.rounds}: {name}", file=sys.stderr)
                rounds[name].append(_round(port, args.requests, args.seconds))
    finally:
        lm.stop()
        kv.stop()
        target.stop()
    med = {name: _medians(rs) for name, rs in rounds.items()}
    res = {"machine": machine.describe(), "args": vars(args), "medians": med, "rounds": rounds}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "control_routes.json").write_text(json.dumps(res, indent=2))
    info = res["machine"]
    print(
        f"\nmachine: {info['cpu']}, {info['cores']} cores, Python {info['python']}, "
        f"commit {info['commit']}; medians of {args.rounds} rounds\n"
    )
    print(table(med))
    return 0


if __name__ == "__main__":
    sys.exit(main())
