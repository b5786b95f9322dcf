"""The fault campaign's ``frozen_engine`` case: an engine frozen behind the router.

Owns the case as an operator meets it: a fleet of its own (a coordinator, two cache
servers, one reference engine in front of each on ``tiny-random``, one torch thread),
``kvatlas router`` in front (``round-robin``, so half the requests go to the engine that
freezes; ``--engine-timeout-s`` left at 600 s; probes every ``HEALTH_S`` with a
``PROBE_TIMEOUT_S`` timeout) and ``CLIENTS`` clients sending requests one after another
(every third a stream). After ``BEFORE_S`` of load engine 0 is frozen with SIGSTOP (its
sockets stay open, nothing answers), thawed with SIGCONT after the hold, and the load
runs ``AFTER_S`` more. Every request is a timeline point (its start in seconds since
the freeze, its duration, the engine that answered, whether it was retried, and its
outcome: ``ok``; ``cut``, a stream that had begun on the frozen engine and ended with
the router's error event naming the cause; ``lost``, anything else: no answer, an error
status, a stream that ended otherwise). The router's view of the frozen engine is
polled every ``POLL_S`` (when it went out, when it came back). Targets: no request lost,
no request slower than ``BOUND_S`` (one that waited on the frozen engine to the end
would take the 600 s timeout), the engine back in rotation after the thaw. Must not:
print (``say``) or write files (``fault_engine_race_report``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

import httpx

from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.metrics import percentiles
from kvatlas.launch.procs import Proc
from kvatlas.router.service import ROUTE_HEADER

Say = Callable[[str], None]
FROZEN_ENGINE: Final = "frozen_engine"
CLIENTS: Final = 4
HEALTH_S: Final = 0.5
PROBE_TIMEOUT_S: Final = 1.0
BEFORE_S: Final = 3.0
AFTER_S: Final = 4.0
POLL_S: Final = 0.1
BOUND_S: Final = 10.0
"""The slowest a request may be: a probe's bound (``HEALTH_S + PROBE_TIMEOUT_S``) plus
its answer from the other engine, with a loaded machine's margin."""
MAX_TOKENS: Final = 16


@dataclass(frozen=True, slots=True)
class FrozenEngineConfig:
    """What the case takes from the campaign's ``FaultsConfig``."""

    hold_s: float = 5.0
    """How long the engine stays frozen."""
    recover_timeout_s: float = 30.0
    """How long the thawed engine may take to be back in the router's rotation."""
    fleet: FleetConfig = field(default_factory=FleetConfig)


def _route(headers: httpx.Headers) -> tuple[str, bool]:
    """(engine, retried) from the route header (``engine=URL; cached=N; reason=R;
    overhead_ms=X``, whose reason ends ``; retry`` when the request was sent elsewhere
    after an engine failed it)."""
    parts = headers.get(ROUTE_HEADER, "").split("; ")
    engine = next((p.removeprefix("engine=") for p in parts if p.startswith("engine=")), "")
    return engine, "retry" in parts


def _request(http: httpx.Client, router: str, client: int, i: int, t0: float) -> dict[str, Any]:
    """One request of the load: its timeline point."""
    stream = i % 3 == 2
    body = {
        "messages": [{"role": "user", "content": f"client {client} question {i}"}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream,
    }  # fmt: skip
    start = time.monotonic()
    point: dict[str, Any] = {"t_s": round(start - t0, 3), "stream": stream, "engine": "",
                             "retried": False, "outcome": "lost", "detail": ""}  # fmt: skip
    try:
        with http.stream("POST", f"{router}/v1/chat/completions", json=body) as r:
            point["engine"], point["retried"] = _route(r.headers)
            if r.status_code != 200:
                point["detail"] = f"status {r.status_code}: {r.read()[:200]!r}"
            elif not stream:
                ok = bool(r.read()) and "choices" in r.json()
                point["outcome"] = "ok" if ok else "lost"
            else:
                lines = [line for line in r.iter_lines() if line]
                last = lines[-1] if lines else ""
                if last == "data: [DONE]":
                    point["outcome"] = "ok"
                elif "stopped answering" in last:
                    point["outcome"], point["detail"] = "cut", last[:300]
                else:
                    point["detail"] = f"stream ended with {last[:200]!r}"
    except httpx.HTTPError as exc:
        point["detail"] = repr(exc)
    point["s"] = round(time.monotonic() - start, 3)
    return point


def _engine_proc(fleet: Fleet, name: str) -> Proc:
    return next(p for p in fleet.extras if p.name == name)


def run_frozen_engine(cfg: FrozenEngineConfig, say: Say) -> dict[str, Any]:
    """Run the case on a fleet of its own; its document (see the module doc)."""
    fcfg = replace(cfg.fleet, nodes=2, p2p=False, coordinators=1, kafka_bootstrap="")
    say(f"{FROZEN_ENGINE}: two engines behind kvatlas router, engine 0 frozen under load")
    with Fleet(fcfg) as fleet:
        fleet.start(lambda m: say(f"  {m}"))
        urls = fleet.start_engines("tiny-random", ("--num-threads", "1"))
        router = fleet.start_router(
            "round-robin",
            ("--health-interval-s", str(HEALTH_S), "--probe-timeout-s", str(PROBE_TIMEOUT_S),
             "--refresh-interval-s", "0.5", "--seed", "1"),
        )  # fmt: skip
        fleet.wait_router_engines(router, len(urls), 60.0)
        victim = _engine_proc(fleet, "engine-0")
        return _measure(cfg, fleet, router, victim, urls[0])


def _measure(
    cfg: FrozenEngineConfig, fleet: Fleet, router: str, victim: Proc, frozen: str
) -> dict[str, Any]:
    points: list[dict[str, Any]] = []
    seen: list[tuple[float, bool]] = []
    stop = threading.Event()
    lock = threading.Lock()
    t0 = time.monotonic() + BEFORE_S  # the freeze, on the timeline's clock

    def client(c: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = 0
            while not stop.is_set():
                p = _request(http, router, c, i, t0)
                with lock:
                    points.append(p)
                i += 1

    def poll() -> None:
        with httpx.Client(timeout=2) as http:
            while not stop.is_set():
                try:
                    engines = http.get(f"{router}/status").json()["engines"]
                    up = any(e["url"] == frozen and e["available"] for e in engines)
                    seen.append((round(time.monotonic() - t0, 3), up))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                stop.wait(POLL_S)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
    threads.append(threading.Thread(target=poll, daemon=True))
    for t in threads:
        t.start()
    thawed_at = back_at = None
    try:
        time.sleep(max(0.0, t0 - time.monotonic()))
        fleet.freeze(victim)
        time.sleep(cfg.hold_s)
    finally:
        fleet.thaw(victim)
    thawed_at = time.monotonic() - t0
    deadline = time.monotonic() + cfg.recover_timeout_s
    while time.monotonic() < deadline and back_at is None:
        back_at = next((t for t, up in list(seen) if up and t > thawed_at), None)
        time.sleep(POLL_S)
    time.sleep(AFTER_S)
    stop.set()
    for t in threads:
        t.join(150)
    out_at = next((t for t, up in seen if not up and t >= 0), None)
    return summarize(
        points, out_at=out_at, thawed_at=thawed_at, back_at=back_at, frozen=frozen, cfg=cfg
    )


def summarize(
    points: list[dict[str, Any]],
    *,
    out_at: float | None,
    thawed_at: float,
    back_at: float | None,
    frozen: str,
    cfg: FrozenEngineConfig,
) -> dict[str, Any]:
    """The case's document from its timeline points and events."""
    points = sorted(points, key=lambda p: p["t_s"])
    lost = [p for p in points if p["outcome"] == "lost"]
    cut = [p for p in points if p["outcome"] == "cut"]
    retried = [p for p in points if p["retried"]]
    slowest = max((p["s"] for p in points), default=0.0)
    targets = {
        "no_request_lost": not lost,
        "slowest_within_bound": slowest <= BOUND_S,
        "frozen_engine_taken_out": out_at is not None,
        "back_after_thaw": back_at is not None,
        "cut_only_on_frozen": all(p["engine"] == frozen for p in cut),
    }
    return {
        "name": FROZEN_ENGINE,
        "description": "SIGSTOP of one of two engines behind kvatlas router under load,"
        " SIGCONT after the hold",
        "clients": CLIENTS,
        "health_interval_s": HEALTH_S,
        "probe_timeout_s": PROBE_TIMEOUT_S,
        "hold_s": cfg.hold_s,
        "bound_s": BOUND_S,
        "frozen_engine": frozen,
        "events_s": {
            "freeze": 0.0,
            "out": out_at,
            "thaw": round(thawed_at, 3),
            "back": back_at,
        },
        "requests": len(points),
        "streams": sum(p["stream"] for p in points),
        "lost": len(lost),
        "cut": len(cut),
        "retried": len(retried),
        "latency_s": percentiles([p["s"] for p in points]),
        "slowest_s": slowest,
        "lost_details": [p["detail"] for p in lost[:10]],
        "timeline": points,
        "targets": targets,
        "passed": all(targets.values()),
    }
