"""HTTP edge benchmark: kvatlas' own HTTP/1.1 server against uvicorn, on the same handlers.

Run: `python -m bench.http_edge_bench [--seconds 0.75] [--repeats 3] [--conns 4]
[--baseline-edge DIR]`.

Why it exists: the coordinator serves HTTP with `kvatlas.coordinator.http.edge` (uvloop and
httptools, no ASGI) instead of uvicorn and Starlette, which the cache server and the
engine use, on the ground that the ASGI cycle costs more per request than the handlers
of the coordinator's hot routes do. This measures that, so that anyone can re-check it.

Servers, each its own process on 127.0.0.1, one worker, uvloop and httptools everywhere:
- `runtime`: `kvatlas.coordinator.http.edge.server.HttpServer` with a `Router` of plain handlers
  (as the coordinator's routes are);
- `uvicorn+starlette`: uvicorn serving a Starlette app (as the cache server does);
- `uvicorn (raw ASGI)`: uvicorn serving a bare ASGI callable, to tell uvicorn's part from
  Starlette's;
- `bare protocol`: an asyncio protocol that finds the end of each request and writes a
  canned answer: no parsing, no handler. It is the floor under every server (the client,
  the loopback and the event loop), so that `server - bare` is what a server costs;
- `edge-baseline` (with ``--baseline-edge DIR``): the same as `runtime`, but with the
  modules of ``kvatlas.coordinator.http.edge`` taken from DIR first (a copy of the package at
  an earlier commit), to measure a change of the edge against what it replaces in the
  same run.

Handlers, the same logic in every server: `GET /healthz` answers `{"ok":true}`; `POST
/ingest` decodes a ~20 KB JSON body (256 entries, pre-encoded once) with a msgspec
decoder into Structs and answers how many entries it held.

Client: this process, plain sockets, keep-alive, requests pre-encoded, responses framed
by their content-length. Two modes per server and handler: `1 conn` (one request at a
time on one connection: the latency of a request) and `N conns` (N connections, one
request in flight on each, driven by one selector loop: requests/s under load). Servers
are measured in turn within each repeat, so that all see the same noise, each repeat
starting one server later than the last; each figure is the median over the repeats.
Bounded: every measurement stops after --seconds (or --max-requests); the whole run takes
about a minute. Prints a markdown table of the medians, then each repeat's ratios (on a
shared, busy machine the ratio within one repeat is steadier than any one figure);
writes JSON to bench/results/http_edge.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import selectors
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.machine import describe
from kvatlas.launch.procs import HOST, free_ports, launch, python_module

RESULTS = Path(__file__).resolve().parent / "results" / "http_edge.json"
SERVERS = ["runtime", "uvicorn+starlette", "uvicorn-asgi", "bare"]
BASELINE = "edge-baseline"
LABELS = {
    "runtime": "coordinator's edge (no ASGI)",
    BASELINE: "coordinator's edge, baseline copy",
    "uvicorn+starlette": "uvicorn + Starlette",
    "uvicorn-asgi": "uvicorn, raw ASGI app",
    "bare": "bare protocol (floor)",
}
HANDLERS = ["healthz", "ingest"]
WARMUP = 200


# ---- the handlers' logic, shared by every server -------------------------------------


class Entry(msgspec.Struct, frozen=True):
    chunk_hash: str
    size: int
    tier: str


class Batch(msgspec.Struct, frozen=True):
    instance_id: str
    seq: int
    entries: list[Entry]


class Applied(msgspec.Struct, frozen=True):
    applied: int


_decoder = msgspec.json.Decoder(Batch)
_encoder = msgspec.json.Encoder()
HEALTHZ = b'{"ok":true}'


def ingest(body: bytes) -> bytes:
    return _encoder.encode(Applied(len(_decoder.decode(body).entries)))


def ingest_body() -> bytes:
    entries = [Entry(f"{i:064x}", 65536, "l1") for i in range(256)]
    return msgspec.json.encode(Batch("bench-instance", 1, entries))


def requests() -> dict[str, bytes]:
    body = ingest_body()
    return {
        "healthz": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        "ingest": b"POST /ingest HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
    }


# ---- servers (each runs in its own process: `--serve NAME --port N`) -----------------


def serve_baseline(port: int, edge_dir: str) -> None:
    """`serve_runtime` with the edge package's modules looked up in ``edge_dir`` first."""
    import kvatlas.coordinator.http.edge as edge  # noqa: PLC0415

    edge.__path__.insert(0, str(Path(edge_dir).resolve()))
    serve_runtime(port)


def serve_runtime(port: int) -> None:
    # Each server process imports only its own stack (here and in the serve_* below).
    from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse  # noqa: PLC0415
    from kvatlas.coordinator.http.edge.routing import Router  # noqa: PLC0415
    from kvatlas.coordinator.http.edge.server import HttpServer  # noqa: PLC0415

    def healthz(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, HEALTHZ)

    def post(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, ingest(bytes(request.body)))

    router = Router()
    router.add("GET", "/healthz", healthz)
    router.add("POST", "/ingest", post)
    server = HttpServer(router, lambda exc: None, max_body_bytes=1 << 20)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    sock = socket.socket()
    sock.bind((HOST, port))
    sock.listen(1024)
    server.run(sock)


def serve_starlette(port: int) -> None:
    import uvicorn  # noqa: PLC0415
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import Response  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    async def healthz(request: Request) -> Response:
        return Response(HEALTHZ, media_type="application/json")

    async def post(request: Request) -> Response:
        return Response(ingest(await request.body()), media_type="application/json")

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/ingest", post, methods=["POST"]),
        ]
    )
    _uvicorn(uvicorn, app, port)


def serve_asgi(port: int) -> None:
    import uvicorn  # noqa: PLC0415

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/ingest":
            parts = []
            while True:
                message = await receive()
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            body = ingest(b"".join(parts))
        else:
            body = HEALTHZ
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    _uvicorn(uvicorn, app, port)


def _uvicorn(uvicorn: Any, app: Any, port: int) -> None:
    uvicorn.run(
        app,
        host=HOST,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="off",
        log_level="warning",
        access_log=False,
    )


class _Bare(asyncio.Protocol):
    """Finds where each request ends (headers, then content-length bytes) and answers
    with canned bytes."""

    ANSWER = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (
            len(HEALTHZ),
            HEALTHZ,
        )
    )

    def __init__(self) -> None:
        self.buf = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            at = buf.find(b"Content-Length: ", 0, end)
            length = int(buf[at + 16 : buf.find(b"\r\n", at)]) if at >= 0 else 0
            if len(buf) < end + 4 + length:
                break
            buf = buf[end + 4 + length :]
            self.transport.write(self.ANSWER)
        self.buf = buf


def serve_bare(port: int) -> None:
    import uvloop  # noqa: PLC0415

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Bare, HOST, port, backlog=1024)
        await server.serve_forever()

    uvloop.run(main())


SERVE: dict[str, Callable[[int], None]] = {
    "runtime": serve_runtime,
    "uvicorn+starlette": serve_starlette,
    "uvicorn-asgi": serve_asgi,
    "bare": serve_bare,
}


class Served:
    """One server process, started and stopped by pid; its output goes to ``log``."""

    def __init__(self, name: str, port: int, log: Path, edge_dir: str | None = None) -> None:
        self.name, self.port = name, port
        extra = ["--edge-dir", edge_dir] if name == BASELINE and edge_dir else []
        argv = python_module("bench.http_edge_bench", "--serve", name, "--port", str(port), *extra)
        self.proc = launch(argv, name=name, log=log, http_port=port, wait=False)

    def wait(self) -> None:
        # The bare protocol answers any request, so the readiness probe works on all four.
        self.proc.wait_http(timeout=30)

    def stop(self) -> None:
        self.proc.stop(grace_s=10.0)


# ---- the client ------------------------------------------------------------------------


def _framed(buf: bytes | bytearray) -> int:
    """The length of the first whole response in ``buf``, or 0 while it is incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return 0
    head = bytes(buf[:end]).lower()
    at = head.find(b"content-length:")
    length = 0
    if at >= 0:
        eol = head.find(b"\r\n", at)
        length = int(head[at + 15 : eol if eol >= 0 else end])
    total = end + 4 + length
    return total if len(buf) >= total else 0


def _connect(port: int) -> socket.socket:
    s = socket.create_connection((HOST, port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def one_connection(
    port: int, request: bytes, seconds: float, max_requests: int
) -> tuple[list[int], float]:
    """Latencies (ns) of requests sent one at a time on one kept-alive connection, and
    the elapsed seconds, for ``seconds`` after a warm-up."""
    s = _connect(port)
    lat: list[int] = []
    started = stop_at = 0
    try:
        n = 0
        while n < max_requests + WARMUP:
            t0 = time.perf_counter_ns()
            s.sendall(request)
            buf = s.recv(65536)
            while not (size := _framed(buf)):
                more = s.recv(65536)
                if not more:
                    raise ConnectionError("server closed the connection")
                buf += more
            if size != len(buf):
                raise ConnectionError("more bytes than one response")
            t1 = time.perf_counter_ns()
            n += 1
            if n > WARMUP:
                lat.append(t1 - t0)
                if t1 > stop_at:
                    break
            elif n == WARMUP:
                started, stop_at = t1, t1 + int(seconds * 1e9)
    finally:
        s.close()
    return lat, (time.perf_counter_ns() - started) / 1e9


def many_connections(
    port: int, request: bytes, seconds: float, max_requests: int, conns: int
) -> tuple[list[int], float]:
    """Latencies (ns) and the elapsed seconds with ``conns`` connections, one request in
    flight on each, for ``seconds`` after a warm-up."""
    sel = selectors.DefaultSelector()
    socks = [_connect(port) for _ in range(conns)]
    state: dict[socket.socket, list[Any]] = {}
    lat: list[int] = []
    done = 0
    started = stop_at = 0
    try:
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            state[s] = [time.perf_counter_ns(), b""]
            s.sendall(request)
        while True:
            for key, _ in sel.select(10):
                s = key.fileobj  # type: ignore[assignment]
                st = state[s]
                data = s.recv(65536)
                if not data:
                    raise ConnectionError("server closed the connection")
                st[1] += data
                if not _framed(st[1]):
                    continue
                now = time.perf_counter_ns()
                done += 1
                if done == WARMUP:
                    started, stop_at = now, now + int(seconds * 1e9)
                elif done > WARMUP:
                    lat.append(now - st[0])
                st[0], st[1] = now, b""
                s.sendall(request)
            if stop_at and (time.perf_counter_ns() > stop_at or len(lat) >= max_requests):
                break
    finally:
        sel.close()
        for s in socks:
            s.close()
    return lat, (time.perf_counter_ns() - started) / 1e9


def _summary(lat: list[int], elapsed_s: float) -> dict[str, float]:
    ordered = sorted(lat)
    n = len(ordered)
    return {
        "requests": n,
        "rps": n / elapsed_s,
        "p50_us": ordered[n // 2] / 1e3,
        "p99_us": ordered[min(n - 1, int(n * 0.99))] / 1e3,
    }


# ---- the run ---------------------------------------------------------------------------


def measure(
    servers: Sequence[str],
    repeats: int,
    seconds: float,
    max_requests: int,
    conns: int,
    edge_dir: str | None = None,
) -> dict[str, Any]:
    reqs = requests()
    ports = free_ports(len(servers))
    logs = Path(tempfile.mkdtemp(prefix="kvatlas-http-edge-"))
    procs = {
        name: Served(name, port, logs / f"{i}.log", edge_dir)
        for i, (name, port) in enumerate(zip(servers, ports, strict=True))
    }
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        for p in procs.values():
            p.wait()
        names = list(procs)
        for r in range(repeats):
            # Each repeat starts one server later, so that none is always measured
            # right after the same neighbour (on a busy machine, that showed).
            for name in names[r % len(names) :] + names[: r % len(names)]:
                p = procs[name]
                for handler in HANDLERS:
                    lat, took = one_connection(p.port, reqs[handler], seconds, max_requests)
                    runs.setdefault(f"{name}|{handler}|1", []).append(_summary(lat, took))
                    lat, took = many_connections(
                        p.port, reqs[handler], seconds, max_requests, conns
                    )
                    runs.setdefault(f"{name}|{handler}|{conns}", []).append(_summary(lat, took))
    finally:
        for p in procs.values():
            p.stop()
    medians = {
        key: {m: statistics.median(r[m] for r in rs) for m in ("rps", "p50_us", "p99_us")}
        for key, rs in runs.items()
    }
    return {"runs": runs, "medians": medians}


def table(medians: dict[str, dict[str, float]], servers: Sequence[str], conns: int) -> str:
    rows = [
        "| handler | server | 1 conn: req/s | p50 / p99 | p50 over the floor |"
        f" {conns} conns: req/s | p50 / p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for handler in HANDLERS:
        floor = medians.get(f"bare|{handler}|1", {}).get("p50_us")
        for name in servers:
            one, many = medians[f"{name}|{handler}|1"], medians[f"{name}|{handler}|{conns}"]
            cost = "" if floor is None or name == "bare" else f"{one['p50_us'] - floor:.0f} us"
            rows.append(
                f"| {handler} | {LABELS[name]} | {one['rps']:,.0f} |"
                f" {one['p50_us']:.0f} / {one['p99_us']:.0f} us | {cost} |"
                f" {many['rps']:,.0f} | {many['p50_us']:.0f} / {many['p99_us']:.0f} us |"
            )
    return "\n".join(rows)


def ratios(medians: dict[str, dict[str, float]], conns: int) -> dict[str, dict[str, float]]:
    """uvicorn + Starlette against the runtime server: how many times slower."""
    out: dict[str, dict[str, float]] = {}
    for handler in HANDLERS:
        rt1, uv1 = (
            medians.get(f"runtime|{handler}|1"),
            medians.get(f"uvicorn+starlette|{handler}|1"),
        )
        rtn = medians.get(f"runtime|{handler}|{conns}")
        uvn = medians.get(f"uvicorn+starlette|{handler}|{conns}")
        if rt1 and uv1 and rtn and uvn:
            out[handler] = {
                "p50_1conn": uv1["p50_us"] / rt1["p50_us"],
                "rps_1conn": rt1["rps"] / uv1["rps"],
                f"rps_{conns}conns": rtn["rps"] / uvn["rps"],
            }
    return out


def ratios_per_repeat(
    runs: dict[str, list[dict[str, float]]], conns: int, other: str = "uvicorn+starlette"
) -> dict[str, list[dict[str, float]]]:
    """`ratios` within each repeat (``other`` against the runtime server, measured one
    right after the other): on a busy machine, steadier than a ratio of medians."""
    out: dict[str, list[dict[str, float]]] = {}
    for handler in HANDLERS:
        keys = [
            (f"runtime|{handler}|1", f"{other}|{handler}|1"),
            (f"runtime|{handler}|{conns}", f"{other}|{handler}|{conns}"),
        ]
        if any(k not in runs for pair in keys for k in pair):
            continue
        (rt1, ot1), (rtn, otn) = ([runs[a], runs[b]] for a, b in keys)
        out[handler] = [
            {
                "p50_1conn": o1["p50_us"] / r1["p50_us"],
                "rps_1conn": r1["rps"] / o1["rps"],
                f"rps_{conns}conns": rn["rps"] / on["rps"],
            }
            for r1, o1, rn, on in zip(rt1, ot1, rtn, otn, strict=True)
        ]
    return out


def _print_per_repeat(per: dict[str, list[dict[str, float]]], conns: int, what: str) -> None:
    for handler, reps in per.items():
        cells = "; ".join(
            f"{r['p50_1conn']:.2f}x / {r['rps_1conn']:.2f}x / {r[f'rps_{conns}conns']:.2f}x"
            for r in reps
        )
        print(f"{handler}, {what} per repeat (p50 1 conn / req/s 1 conn / req/s {conns}): {cells}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=0.75, help="per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-requests", type=int, default=50_000, help="per measurement")
    ap.add_argument("--conns", type=int, default=4, help="connections of the loaded mode")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument(
        "--baseline-edge",
        metavar="DIR",
        help="also serve the edge with its modules taken from DIR first (an earlier copy"
        " of src/kvatlas/coordinator/edge), beside the current one",
    )
    ap.add_argument("--serve", choices=[*SERVERS, BASELINE], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--edge-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve == BASELINE:
        serve_baseline(args.port, args.edge_dir)
        return 0
    if args.serve:
        SERVE[args.serve](args.port)
        return 0
    servers = [s for s in args.servers.split(",") if s]
    if args.baseline_edge and BASELINE not in servers:
        servers.insert(servers.index("runtime") + 1 if "runtime" in servers else 0, BASELINE)
    started = time.time()
    out = measure(
        servers, args.repeats, args.seconds, args.max_requests, args.conns, args.baseline_edge
    )
    machine = describe()
    print(
        f"\nHTTP edge: {args.repeats} repeats of {args.seconds} s per measurement, medians;"
        f" {machine['cpu']}, {machine['cores']} cores (client and servers share them)\n"
    )
    print(table(out["medians"], servers, args.conns))
    rat = ratios(out["medians"], args.conns)
    for handler, r in rat.items():
        print(
            f"\n{handler}: uvicorn + Starlette p50 (1 conn) is {r['p50_1conn']:.2f}x the"
            f" runtime server's; the runtime server serves {r['rps_1conn']:.2f}x the"
            f" requests/s on 1 conn and {r[f'rps_{args.conns}conns']:.2f}x on"
            f" {args.conns} conns",
            end="",
        )
    print("\n")
    per = ratios_per_repeat(out["runs"], args.conns)
    _print_per_repeat(per, args.conns, "uvicorn + Starlette against the edge")
    base = ratios_per_repeat(out["runs"], args.conns, BASELINE) if args.baseline_edge else {}
    _print_per_repeat(base, args.conns, "the baseline edge against the current one")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": machine,
                "args": vars(args),
                "seconds": round(time.time() - started, 1),
                "ratios": rat,
                "ratios_per_repeat": per,
                "baseline_ratios_per_repeat": base,
                **out,
            },
            indent=1,
        )
    )
    print(f"\nwrote {RESULTS} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
