"""The router's per-request prefix lookup: its own HTTP/1.1 client against httpx.

    python -m bench.lookup_client_bench [--repeats 2000] [--block 50]
        [--prompt-tokens 256,4096,32768]

A ``kvatlas coordinator`` process on 127.0.0.1 holds, per prompt size, a prompt's chunks
on two instances. One uvloop event loop in this process (the router's loop) then asks
``POST /directory/lookup`` for the same prompt, side by side, through:

- ``own``: `kvatlas.runtime.coordinator_lookups.AsyncLookups`, what the router uses
  (``asyncio.Protocol`` connections of its own, httptools);
- ``httpx``: the fleet's client factory (`kvatlas.runtime.http_clients.async_fleet_client`),
  the same msgpack body and headers, the answer decoded the same way (only
  ``prefix_holders``), over httpx's keep-alive pool.

Both clients are warmed, then alternate in blocks of ``--block`` lookups (which goes
first switches per block) until each made ``--repeats``. Per lookup: the wall time
around the call; per block: this process's CPU time (the coordinator runs in another).
Reported per client: the median and p99 of the lookups, the median of the coordinator's
own ``Server-Timing`` ``app`` time, the median client time above it, and the CPU per
lookup (median of the blocks); and the median difference, httpx minus own. The
machine's 1-minute load average before and after says how busy it was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import uvloop

from bench.machine import describe
from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey, chunk_hashes, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.launch.procs import HOST, free_ports, launch, python_module
from kvatlas.runtime.coordinator_client import CoordinatorClient
from kvatlas.runtime.coordinator_lookups import LOOKUP_PATH, AsyncLookups
from kvatlas.runtime.http_clients import async_fleet_client
from kvatlas.wire.directory_api import HolderWire, LookupRequest
from kvatlas.wire.http_api import MSGPACK_CONTENT_TYPE
from kvatlas.wire.instances_api import RegisterRequest

MODEL = "bench-model"
WARM_UP = 200
_HEADERS = {"content-type": MSGPACK_CONTENT_TYPE, "accept": "application/json"}


class _Holders(msgspec.Struct):
    prefix_holders: list[HolderWire] = []


_holders = msgspec.json.Decoder(_Holders)
Ask = Callable[[], Awaitable[tuple[int, float | None]]]
"""One lookup: the holders found and the coordinator's own seconds."""


@contextmanager
def _coordinator() -> Iterator[str]:
    port = free_ports(1)[0]
    argv = python_module("kvatlas.cli.coordinator", "--host", HOST, "--port", str(port))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "coordinator.log"
        with launch(argv, name="coordinator", log=log, http_port=port, timeout=60):
            yield f"http://{HOST}:{port}"


def _prompt(n: int) -> list[int]:
    return [(7919 * i + n) % 49152 for i in range(n)]


def _fill(client: CoordinatorClient, sizes: list[int]) -> None:
    """node-a holds every prompt whole, node-b its first half."""
    rank = default_kv_rank(1)
    seqs = {"node-a": 0, "node-b": 0}
    for iid in seqs:
        client.register(
            RegisterRequest(
                ip=HOST, http_port=7555, instance_id=InstanceId(iid), incarnation=Incarnation(1)
            )
        )
    for n in sizes:
        hashes = chunk_hashes(_prompt(n), 256)
        for iid, held in (("node-a", hashes), ("node-b", hashes[: max(1, len(hashes) // 2)])):
            seqs[iid] += 1
            entries = tuple(Entry(ObjectKey(h, MODEL, rank), 1024) for h in held)
            client.post_events(
                [
                    EventBatch(
                        InstanceId(iid),
                        Incarnation(1),
                        seqs[iid],
                        EventType.STORE,
                        Tier.L1,
                        entries,
                    )
                ]
            )


def _app_s(header: str | None) -> float | None:
    for metric in (header or "").split(","):
        name, _, params = metric.strip().partition(";")
        if name == "app" and params.startswith("dur="):
            return float(params[4:]) / 1000
    return None


def _q(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


async def _compare(base: str, blob: bytes, repeats: int, block: int) -> dict[str, Any]:
    """The two clients on one loop for one prompt (see the module doc)."""
    body = msgspec.msgpack.encode(LookupRequest(tokens_b64=blob, model_name=MODEL))
    coordinator = CoordinatorClient(base, timeout_s=5.0)
    own: AsyncLookups = coordinator.async_lookups()
    fleet = async_fleet_client(timeout=5.0)
    url = base + LOOKUP_PATH

    async def ask_own() -> tuple[int, float | None]:
        answer = await own.holders(blob, MODEL, timeout_s=5.0)
        return len(answer.holders), answer.server_s

    async def ask_httpx() -> tuple[int, float | None]:
        resp = await fleet.post(url, content=body, headers=_HEADERS)
        resp.raise_for_status()
        found = _holders.decode(resp.content).prefix_holders
        return len(found), _app_s(resp.headers.get("server-timing"))

    asks: dict[str, Ask] = {"own": ask_own, "httpx": ask_httpx}
    wall: dict[str, list[float]] = {k: [] for k in asks}
    server: dict[str, list[float]] = {k: [] for k in asks}
    cpu: dict[str, list[float]] = {k: [] for k in asks}
    try:
        for name, ask in asks.items():
            for _ in range(WARM_UP):
                found, _s = await ask()
                assert found == 2, f"{name}: {found} holders, not 2"
        turn = 0
        while len(wall["own"]) < repeats:
            order = list(asks) if turn % 2 == 0 else list(reversed(asks))
            turn += 1
            for name in order:
                ask = asks[name]
                cpu0 = time.process_time()
                for _ in range(block):
                    t0 = time.perf_counter()
                    _found, app = await ask()
                    wall[name].append(time.perf_counter() - t0)
                    if app is not None:
                        server[name].append(app)
                cpu[name].append((time.process_time() - cpu0) / block)
    finally:
        await own.aclose()
        await fleet.aclose()
        coordinator.close()
    out: dict[str, Any] = {}
    for name in asks:
        ms = [s * 1000 for s in wall[name]]
        app_ms = statistics.median(server[name]) * 1000 if server[name] else 0.0
        out[name] = {
            "p50_ms": round(statistics.median(ms), 4),
            "p99_ms": round(_q(ms, 0.99), 4),
            "server_p50_ms": round(app_ms, 4),
            "client_above_server_p50_ms": round(statistics.median(ms) - app_ms, 4),
            "cpu_per_lookup_ms": round(statistics.median(cpu[name]) * 1000, 4),
        }
    out["httpx_minus_own_p50_ms"] = round(out["httpx"]["p50_ms"] - out["own"]["p50_ms"], 4)
    out["httpx_minus_own_cpu_ms"] = round(
        out["httpx"]["cpu_per_lookup_ms"] - out["own"]["cpu_per_lookup_ms"], 4
    )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--prompt-tokens", default="256,4096,32768")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.prompt_tokens.split(",")]
    out: dict[str, Any] = {
        "machine": describe(),
        "repeats": args.repeats,
        "block": args.block,
        "load_average_before": os.getloadavg()[0],
        "results": {},
    }
    with _coordinator() as base:
        with CoordinatorClient(base, timeout_s=10.0) as client:
            _fill(client, sizes)
        for n in sizes:
            blob = np.asarray(_prompt(n), dtype="<u4").tobytes()
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                out["results"][str(n)] = runner.run(_compare(base, blob, args.repeats, args.block))
    out["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
