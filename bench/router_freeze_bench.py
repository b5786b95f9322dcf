"""Freeze to failover: how long a request waits on an engine that froze.

    python -m bench.router_freeze_bench [--rounds 5] [--settings 1.0:2.0,0.2:1.0]
        [--engine-threads 1]

Starts two reference engines on the tiny random model as processes of their own
(``--no-cache``, ``--num-threads`` from ``--engine-threads``, 1) and
``kvatlas router --policy round-robin`` in this process in front of them, once per
``HEALTH:PROBE_TIMEOUT`` setting (``--health-interval-s`` and ``--probe-timeout-s``; the
first is the defaults). Each round: a long stream runs on
engine A, a request waits behind it for A's first byte, A is frozen with SIGSTOP; then
measured: SIGSTOP to the waiting request's answer (from engine B,
retried: B's own time to serve it included), SIGSTOP to the stream's end (its error
event: the trip itself), and, after SIGCONT, the time until the router sends A
work again. ``--engine-timeout-s`` stays at its 600 s default throughout: every figure is
the probe's. The bound to compare with is one health interval plus the probe timeout.
First, the margin a busy engine has: its ``/metrics`` round trip idle and while it
serves a long prefill and decode (a probe slower than ``--probe-timeout-s`` would fail over
a healthy engine).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

from bench.machine import describe
from kvatlas.launch.procs import Proc, free_port, launch
from kvatlas.router.app import RouterApp
from kvatlas.router.config import RouterConfig, StaticEngine


def _engine(threads: int) -> Proc:
    """A reference engine on a free port, started (not yet awaited: it loads a model)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "kvatlas.cli.engine", "--model", "tiny-random", "--port",
        str(port), "--no-cache", "--max-model-len", "2048", "--log-level", "WARNING",
    ]  # fmt: skip
    if threads:
        argv += ["--num-threads", str(threads)]
    return launch(argv, name=f"engine-{port}", http_port=port, wait=False)


def _wait(what: str, ok: Any, timeout: float = 300.0) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def _chat(content: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
    }  # fmt: skip


def _route(r: httpx.Response) -> str:
    return r.headers["x-kvatlas-route"].split(";", 1)[0].removeprefix("engine=")


def _drain(lines: Any) -> tuple[list[str], float]:
    """The rest of a stream, and when it ended."""
    return list(lines), time.monotonic()


def one_setting(
    a: Proc, b: str, health: float, probe: float, rounds: int
) -> dict[str, list[float]]:
    url_a = a.url
    router = RouterApp(
        RouterConfig(
            port=0,
            engines=(StaticEngine(url_a, "a"), StaticEngine(b, "b")),
            policy="round-robin",
            health_interval_s=health,
            probe_timeout_s=probe,
            seed=1,
            expose_route_header=True,
        )
    )
    router.start()
    out: dict[str, list[float]] = {"answered_s": [], "stream_cut_s": [], "back_s": []}
    api = f"{router.url}/v1/chat/completions"

    def state(url: str) -> Any:
        return next(e for e in router.status().engines if e.url == url)

    try:
        _wait("both engines", lambda: state(url_a).available and state(b).available)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for _ in range(rounds):
                while _route(httpx.post(api, json=_chat("turn", 2), timeout=120)) != b:
                    pass  # round-robin: the next one goes to A
                with httpx.stream("POST", api, json=_chat("story", 1500, True), timeout=700) as s:
                    assert _route(s) == url_a
                    lines = s.iter_lines()
                    next(lines)
                    httpx.post(api, json=_chat("turn", 2), timeout=120)  # B's turn
                    waiting = pool.submit(httpx.post, api, json=_chat("q", 2), timeout=700)
                    _wait("a request waiting on A", lambda: state(url_a).in_flight == 2)
                    cut = pool.submit(_drain, lines)
                    a.freeze()
                    frozen_at = time.monotonic()
                    try:
                        answer = waiting.result()
                        out["answered_s"].append(time.monotonic() - frozen_at)
                        assert answer.status_code == 200 and _route(answer) == b, answer.text
                        rest, cut_at = cut.result()
                        out["stream_cut_s"].append(cut_at - frozen_at)
                        assert any("stopped answering" in line for line in rest), rest[-2:]
                    finally:
                        a.thaw()
                resumed_at = time.monotonic()
                _wait("A back", lambda: state(url_a).available)
                out["back_s"].append(time.monotonic() - resumed_at)
                _wait("nothing in flight", lambda: state(url_a).in_flight == 0)
    finally:
        router.stop()
    return out


def probe_latency(url: str, busy: bool) -> list[float]:
    """``GET /metrics`` round trips (seconds, sorted) on an idle engine, or while it
    serves a long prefill (1,800 prompt tokens) and 200 decode steps."""
    lat: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as c, concurrent.futures.ThreadPoolExecutor(1) as p:
        body = {"prompt": [5 + i % 200 for i in range(1800)], "max_tokens": 200,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        work = p.submit(httpx.post, url + "/v1/completions", json=body, timeout=600)
        if not busy:
            work.result()
        end = time.monotonic() + 10
        while (not work.done()) if busy else time.monotonic() < end:
            t0 = time.perf_counter()
            c.get("/metrics").raise_for_status()
            lat.append(time.perf_counter() - t0)
            time.sleep(0.05)
        assert work.result().status_code == 200
    return sorted(lat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--engine-threads", type=int, default=1, help="the engines' --num-threads (0: torch's)"
    )
    ap.add_argument("--settings", default="1.0:2.0,0.2:1.0", help="HEALTH:PROBE_TIMEOUT,...")
    args = ap.parse_args(argv)
    logging.getLogger("kvatlas.router").setLevel(logging.ERROR)  # each freeze logs warnings
    settings = [tuple(float(x) for x in s.split(":")) for s in args.settings.split(",")]
    print(describe())
    a, b = _engine(args.engine_threads), _engine(args.engine_threads)
    try:
        for engine in (a, b):
            engine.wait_http(timeout=300)
        print("| engine | probes | /metrics p50 | p99 | max |\n|---|---|---|---|---|")
        for busy in (False, True):
            lat = probe_latency(a.url, busy)
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            print(
                f"| {'busy (long prefill + decode)' if busy else 'idle'} | {len(lat)}"
                f" | {lat[len(lat) // 2] * 1000:.1f} ms | {p99 * 1000:.1f} ms"
                f" | {lat[-1] * 1000:.1f} ms |",
                flush=True,
            )
        print()
        print("| health / probe timeout | bound | freeze -> retried answer (min / median / max)"
              " | freeze -> stream cut | SIGCONT -> back in rotation |")  # fmt: skip
        print("|---|---|---|---|---|")
        for health, probe in settings:
            r = one_setting(a, b.url, health, probe, args.rounds)

            def fmt(xs: list[float]) -> str:
                return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f} s"

            print(
                f"| {health:g} s / {probe:g} s | {health + probe:g} s | {fmt(r['answered_s'])}"
                f" | {fmt(r['stream_cut_s'])} | {fmt(r['back_s'])} |",
                flush=True,
            )
    finally:
        for engine in (a, b):
            engine.stop(grace_s=30.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
