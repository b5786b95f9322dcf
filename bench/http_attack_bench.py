"""Normal clients of the coordinator during a slow-client attack.

Run: `python -m bench.http_attack_bench [--seconds 25] [--slow 300] [--bodies 8]`.

Why it exists: the coordinator's HTTP server cuts requests whose headers arrive late
(408 after 10 s) and bodies that arrive slower than 16 KiB/s over a 10 s window, caps the
request bytes buffered at once (`--max-buffered-bytes`, 503 beyond) and the open
connections (503). This measures what normal clients see meanwhile, and the
coordinator's resident memory.

Setup: one real `kvatlas coordinator` process (defaults: 64 MiB body limit, 256 MiB
budget) on 127.0.0.1. The normal client is this process: one kept-alive connection,
requests one at a time, alternating `GET /instances` and a `POST /directory/lookup` of
1,024 token ids (~5 KB of JSON). The attacker is a second process: `--slow` connections
that send their headers a byte per second (each is cut at 10 s and opened again), and
`--bodies` connections that declare 64 MiB bodies, send 60 MiB at once and stall (the
slow-body attack; opened again once cut or refused, at most once a second each). Phases in one
run: `quiet` (no attacker) then `attack` (the attacker running), `--seconds` each; the
figures are the normal requests' p50 / p99 latency and the share that failed. Prints a
markdown table; writes JSON to bench/results/http_attack.json.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.machine import describe
from kvatlas.launch.procs import HOST, Proc, free_port, launch, python_module

RESULTS = Path(__file__).resolve().parent / "results" / "http_attack.json"
MIB = 1 << 20
BODY_DECLARED = 64 * MIB
BODY_SENT = 60 * MIB


# ---- the attacker (its own process: `--attack PORT`) ----------------------------------


def _open_slow(port: int) -> socket.socket | None:
    try:
        s = socket.create_connection((HOST, port), timeout=2)
        s.sendall(b"GET /instances HTTP/1.1\r\nHost: x\r\n")
    except OSError:
        return None
    return s


def _open_body(port: int) -> socket.socket | None:
    """A POST that declares 64 MiB and sends 60 MiB of it, unless refused first."""
    try:
        s = socket.create_connection((HOST, port), timeout=5)
        s.sendall(b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % BODY_DECLARED)
        chunk = b"x" * MIB
        for _ in range(BODY_SENT // MIB):
            if select.select([s], [], [], 0)[0]:
                break  # answered (refused) already
            s.sendall(chunk)
    except OSError:
        return None
    return s


def _answered(s: socket.socket) -> int:
    """The status the server answered on ``s`` (0: it closed without one)."""
    try:
        head = s.recv(4096)
    except OSError:
        return 0
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else 0


def attack(port: int, slow: int, bodies: int, seconds: float) -> dict[str, int]:
    """Keep ``slow`` header tricklers and ``bodies`` stalled bodies open for ``seconds``;
    what the server answered them, by status."""
    answers: dict[str, int] = {}
    tricklers: list[socket.socket | None] = [_open_slow(port) for _ in range(slow)]
    stalled: list[socket.socket | None] = [None] * bodies
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i in range(bodies):
            s = stalled[i]
            if s is not None and select.select([s], [], [], 0)[0]:
                status = str(_answered(s))
                answers[status] = answers.get(status, 0) + 1
                s.close()
                s = None
            stalled[i] = s if s is not None else _open_body(port)
        for i in range(slow):
            t = tricklers[i]
            if t is not None and select.select([t], [], [], 0)[0]:
                status = str(_answered(t))
                answers[status] = answers.get(status, 0) + 1
                t.close()
                t = None
            if t is None:
                tricklers[i] = _open_slow(port)
                continue
            try:
                t.sendall(b"x")
            except OSError:
                t.close()
                tricklers[i] = None
        time.sleep(max(0.0, 1.0 - (time.monotonic() % 1.0)))
    for sock in tricklers + stalled:
        if sock is not None:
            sock.close()
    return answers


# ---- the normal client ----------------------------------------------------------------


def normal_requests(token_count: int) -> list[bytes]:
    body = msgspec.json.encode({"token_ids": list(range(token_count)), "model_name": "m"})
    return [
        b"GET /instances HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /directory/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
    ]


def _status_and_frame(buf: bytes) -> tuple[int, int]:
    """(status, length of the first whole answer in buf), or (0, 0) while incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return 0, 0
    head = buf[:end].lower()
    at = head.find(b"content-length:")
    eol = head.find(b"\r\n", at)
    length = int(head[at + 15 : eol if eol >= 0 else end]) if at >= 0 else 0
    total = end + 4 + length
    return (int(buf.split()[1]), total) if len(buf) >= total else (0, 0)


def normal_client(port: int, seconds: float) -> dict[str, Any]:
    """Requests one at a time on one kept-alive connection (a new one if it is closed)
    for ``seconds``: latency percentiles (us) and failures."""
    reqs = normal_requests(1024)
    lat: list[float] = []
    failed = 0
    s: socket.socket | None = None
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        try:
            if s is None:
                s = socket.create_connection((HOST, port), timeout=10)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(reqs[n % 2])
            buf = b""
            while True:
                more = s.recv(65536)
                if not more:
                    raise ConnectionError("closed")
                buf += more
                status, size = _status_and_frame(buf)
                if size:
                    break
        except OSError:
            failed += 1
            if s is not None:
                s.close()
            s = None
            continue
        finally:
            n += 1
        if status == 200:
            lat.append((time.perf_counter() - t0) * 1e6)
        else:
            failed += 1
    if s is not None:
        s.close()
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [0.0] * 99
    return {
        "requests": n,
        "failed": failed,
        "p50_us": round(q[49], 1),
        "p99_us": round(q[98], 1),
        "max_us": round(max(lat, default=0.0), 1),
    }


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(seconds: float, slow: int, bodies: int) -> dict[str, Any]:
    port = free_port()
    argv = python_module("kvatlas.cli.coordinator", "--host", HOST, "--port", str(port))
    coord = launch(argv, name="coordinator", http_port=port)
    attacker: Proc | None = None
    try:
        rss = {"start": _rss_mib(coord.pid)}
        quiet = normal_client(port, seconds)
        attacker = launch(
            python_module(
                "bench.http_attack_bench", "--attack", str(port), "--slow", str(slow),
                "--bodies", str(bodies), "--seconds", str(seconds + 5),
            ),
            name="attacker",
            pipes=True,
        )  # fmt: skip
        time.sleep(3)  # the attack's connections open and its bodies arrive
        attacked = normal_client(port, seconds)
        rss["attack"] = _rss_mib(coord.pid)
        out_text, _ = attacker.popen.communicate(timeout=seconds + 60)
        answers = json.loads(out_text)
        time.sleep(2)  # one sweep after the attacker's connections closed
        rss["after"] = _rss_mib(coord.pid)
    finally:
        if attacker is not None:
            attacker.kill()
        coord.stop(grace_s=30.0)
    return {"quiet": quiet, "attack": attacked, "attacker_answers": answers, "rss_mib": rss}


def table(out: dict[str, Any]) -> str:
    rows = [
        "| phase | normal requests | failed | p50 | p99 | max |",
        "|---|---|---|---|---|---|",
    ]
    for phase in ("quiet", "attack"):
        m = out[phase]
        rows.append(
            f"| {phase} | {m['requests']:,} | {m['failed']} | {m['p50_us']:.0f} us"
            f" | {m['p99_us']:.0f} us | {m['max_us']:.0f} us |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=25.0, help="per phase")
    ap.add_argument("--slow", type=int, default=300, help="header tricklers of the attack")
    ap.add_argument("--bodies", type=int, default=8, help="stalled 64 MiB bodies of the attack")
    ap.add_argument("--attack", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.attack:
        print(json.dumps(attack(args.attack, args.slow, args.bodies, args.seconds)))
        return 0
    started = time.time()
    out = run(args.seconds, args.slow, args.bodies)
    machine = describe()
    print(
        f"\nHTTP attack: {args.slow} header tricklers and {args.bodies} stalled 64 MiB bodies;"
        f" {args.seconds} s per phase; {machine['cpu']}, {machine['cores']} cores (coordinator,"
        " client and attacker share them)\n"
    )
    print(table(out))
    rss = out["rss_mib"]
    print(
        f"\ncoordinator RSS: {rss['start']:.0f} MiB at start, {rss['attack']:.0f} MiB during the"
        f" attack, {rss['after']:.0f} MiB after it; the attacker was answered"
        f" {out['attacker_answers']}"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": machine,
                "args": vars(args),
                "seconds": round(time.time() - started),
                **out,
            },
            indent=1,
        )
    )
    print(f"\nwrote {RESULTS} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
