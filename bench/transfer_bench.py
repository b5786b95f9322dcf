"""Read bandwidth of every transport next to its baseline, measured in one run.

    python -m bench.transfer_bench [--region-mib 128] [--repeats 11] [--transports tcp,shm,...]

The owner is a separate process holding a real L1 region; the requester reads the whole
region in chunks of 256 KiB, 4 MiB and 16 MiB into its own region and verifies every
chunk's checksum (that is part of every transport's read). Baselines, same sizes, same run:

- raw socket: a plain TCP socket between two processes, ``sendall`` on one side and
  ``recv_into`` a preallocated buffer on the other (no protocol, no checksum);
- copy: ``np.copyto`` between two buffers of this process (no checksum).

Targets: tcp >= 80% of the raw socket, shm >= 70% of the copy; mooncake and nixl as
measured. Mooncake listens on 0.0.0.0, so its part runs in a private network namespace
(``unshare -rn``, needs root) and is skipped with the reason when that fails. Medians
over repeats. Prints a markdown table and writes bench/results/transfer.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.machine import describe
from kvatlas.core.checksum import checksum
from kvatlas.launch.procs import ProcessError, launch, python_module
from kvatlas.runtime.region import L1Region
from kvatlas.transfer.base import Endpoint, ReadOp
from kvatlas.transfer.factory import TRANSPORTS, make_transport

KiB, MiB = 1 << 10, 1 << 20
CHUNKS = (256 * KiB, 4 * MiB, 16 * MiB)
NETNS = frozenset({"mooncake"})
TARGETS = {"tcp": ("raw socket", 0.80), "shm": ("copy", 0.70)}
RESULTS = Path(__file__).resolve().parent / "results" / "transfer.json"
PEER, LEASE = "bench", "bench-lease"


def pattern(size: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(np.random.default_rng(7).bytes(size), dtype=np.uint8)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------- owner side


def owner_main(transport: str, size: int) -> int:
    """Child process: serve a region through ``transport`` (or a raw socket) until stdin closes."""
    with L1Region.create(size, "bench-owner") as region:
        np.copyto(region.array, pattern(size))
        if transport == "raw":
            return _raw_owner(region)
        server = make_transport(transport).server(region, lambda *_: True)
        endpoint = server.start()
        print("ENDPOINT " + json.dumps(endpoint.to_builtins()), flush=True)
        sys.stdin.read()
        server.stop()
        del server
    return 0


def _raw_owner(region: L1Region) -> int:
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"RAW {listener.getsockname()[1]}", flush=True)
    conn, _ = listener.accept()  # the requester closing its socket ends this owner
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(16)
    data = region.buffer
    while True:
        view, got = memoryview(head), 0
        while got < 16:
            k = conn.recv_into(view[got:])
            if k == 0:
                return 0
            got += k
        count, chunk = struct.unpack(">QQ", head)
        for i in range(count):
            start = (i * chunk) % region.size
            conn.sendall(data[start : start + chunk])


class Owner:
    def __init__(self, transport: str, size: int) -> None:
        argv = python_module(
            "bench.transfer_bench", "--owner", transport, "--region-mib", str(size // MiB)
        )
        self.proc = launch(argv, name=f"{transport}-owner", pipes=True)
        stdout = self.proc.popen.stdout
        assert stdout is not None
        self.line = ""
        for line in stdout:
            if line.startswith(("ENDPOINT ", "RAW ")):
                self.line = line
                break
        if not self.line:
            self.proc.kill()
            raise RuntimeError(f"{transport} owner did not start:\n{self.proc.tail()}")

    def endpoint(self) -> Endpoint:
        return Endpoint.from_builtins(json.loads(self.line.split(" ", 1)[1]))

    def stop(self) -> None:
        stdin = self.proc.popen.stdin
        assert stdin is not None
        stdin.close()  # the owner's signal to leave
        with contextlib.suppress(ProcessError):
            self.proc.wait_exit(10)
        self.proc.kill()


# ----------------------------------------------------------------------- measurements

Run = Callable[[int], None]
"""Reads (or copies) the whole region once in chunks of the given size."""


def measure(run: Run, baseline: Run | None, size: int, repeats: int) -> dict[str, Any]:
    """Median GB/s per chunk size. A baseline is timed interleaved with the transport, one
    repeat each in turn, so that both see the same noise of a shared machine."""
    rows: dict[str, Any] = {}
    for chunk in CHUNKS:
        nbytes = (size // chunk) * chunk
        run(chunk)  # warm: connections, page faults of fresh regions
        if baseline is not None:
            baseline(chunk)
        mine, base = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            run(chunk)
            mine.append(time.perf_counter() - t)
            if baseline is not None:
                t = time.perf_counter()
                baseline(chunk)
                base.append(time.perf_counter() - t)
        rows[str(chunk)] = nbytes / statistics.median(mine) / 1e9
        if base:
            rows[f"{chunk}_baseline"] = nbytes / statistics.median(base) / 1e9
    return rows


class RawSocket:
    """The raw-socket baseline: its owner process streams chunks on request."""

    def __init__(self, size: int) -> None:
        self.owner = Owner("raw", size)
        port = int(self.owner.line.split()[1])
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Received into a region of the same kind as the transports write into.
        self.region = L1Region.create(size, "bench-raw")
        self.size = size

    def run(self, chunk: int) -> None:
        count = self.size // chunk
        self.sock.sendall(struct.pack(">QQ", count, chunk))
        view = self.region.buffer
        for i in range(count):
            with view[i * chunk : (i + 1) * chunk] as slot:
                got = 0
                while got < chunk:
                    got += self.sock.recv_into(slot[got:])

    def close(self) -> None:
        self.sock.close()
        self.owner.stop()
        self.region.close()
        self.region.unlink()


class Copy:
    """The copy baseline: np.copyto between two buffers of this process."""

    def __init__(self, size: int) -> None:
        self.src, self.dst = pattern(size).copy(), np.zeros(size, dtype=np.uint8)
        self.size = size

    def run(self, chunk: int) -> None:
        for o in range(0, self.size - chunk + 1, chunk):
            np.copyto(self.dst[o : o + chunk], self.src[o : o + chunk])


def bench_transport(
    transport: str, size: int, repeats: int, baseline: Run | None
) -> dict[str, Any]:
    expected = pattern(size)
    owner = Owner(transport, size)
    try:
        with L1Region.create(size, "bench-reader") as local:
            client = make_transport(transport).client(local, PEER)
            peer = client.connect(owner.endpoint())
            plans = {
                chunk: [
                    ReadOp(o, chunk, o, LEASE, checksum(expected[o : o + chunk].data))
                    for o in range(0, size - chunk + 1, chunk)
                ]
                for chunk in CHUNKS
            }

            def run(chunk: int) -> None:
                results = peer.read(plans[chunk], 60.0)
                bad = [r for r in results if not r.ok]
                if bad:
                    raise RuntimeError(f"{transport}: {len(bad)} failed reads, first {bad[0]}")

            rows = measure(run, baseline, size, repeats)
            time.sleep(0.2)
            before, mine, t0 = cpu_seconds(owner.proc.pid), cpu_seconds(os.getpid()), time.time()
            time.sleep(1.0)
            elapsed = time.time() - t0
            rows["idle_cpu_owner_pct"] = 100 * (cpu_seconds(owner.proc.pid) - before) / elapsed
            rows["idle_cpu_requester_pct"] = 100 * (cpu_seconds(os.getpid()) - mine) / elapsed
            peer.close()
            client.close()
    finally:
        owner.stop()
    return rows


def bench_in_netns(transport: str, size: int, repeats: int) -> dict[str, Any]:
    args = [sys.executable, "-m", "bench.transfer_bench", "--transports", transport, "--child"]
    args += ["--region-mib", str(size // MiB), "--repeats", str(repeats)]
    script = 'ip link set lo up && exec "$@"'
    proc = subprocess.run(
        ["unshare", "-rn", "sh", "-c", script, "sh", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("CHILD "):
            result: dict[str, Any] = json.loads(line[6:])[transport]
            return result
    tail = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("I1"))
    return {"error": f"netns run failed (rc {proc.returncode}): {tail[-600:]}"}


def run_transport(
    transport: str, size: int, repeats: int, child: bool, baseline: Run | None = None
) -> dict[str, Any]:
    try:
        make_transport(transport)
    except Exception as exc:
        return {"error": f"skipped: {exc}"}
    if transport in NETNS and not child:
        return bench_in_netns(transport, size, repeats)
    try:
        return bench_transport(transport, size, repeats, baseline)
    except Exception as exc:  # one failing transport must not hide the others
        return {"error": repr(exc)}


# ----------------------------------------------------------------------------- report


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| transport | chunk | GB/s (median) | baseline GB/s, same run | ratio | target |"
        " idle CPU owner / requester |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        if "error" in rows:
            lines.append(f"| {name} | - | {rows['error']} | | | | |")
            continue
        base_name, target = TARGETS.get(name, ("", 0.0))
        for chunk in CHUNKS:
            gbps = rows[str(chunk)]
            base = rows.get(f"{chunk}_baseline")
            base_txt = ratio = verdict = idle = ""
            if base:
                base_txt = f"{base:.2f} ({base_name})"
                ratio = f"{gbps / base:.0%}"
                verdict = f">= {target:.0%}: {'met' if gbps / base >= target else 'MISSED'}"
            if "idle_cpu_owner_pct" in rows and chunk == CHUNKS[0]:
                owner, mine = rows["idle_cpu_owner_pct"], rows["idle_cpu_requester_pct"]
                idle = f"{owner:.1f}% / {mine:.1f}%"
            label = f"{chunk // MiB} MiB" if chunk >= MiB else f"{chunk // KiB} KiB"
            lines.append(
                f"| {name} | {label} | {gbps:.2f} | {base_txt} | {ratio} | {verdict} | {idle} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--region-mib", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--owner", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = args.region_mib * MiB
    if args.owner:
        return owner_main(args.owner, size)
    transports = [e for e in args.transports.split(",") if e]
    if args.child:
        out = {e: run_transport(e, size, args.repeats, child=True) for e in transports}
        print("CHILD " + json.dumps(out), flush=True)
        return 0
    started = time.time()
    raw, copy = RawSocket(size), Copy(size)
    baselines: dict[str, Run] = {"tcp": raw.run, "shm": copy.run}
    results: dict[str, dict[str, Any]] = {}
    try:
        for transport in transports:
            results[transport] = run_transport(
                transport, size, args.repeats, child=False, baseline=baselines.get(transport)
            )
    finally:
        raw.close()
    machine = describe()
    print(
        f"\nTransfer read bandwidth, {args.region_mib} MiB per measurement, median of"
        f" {args.repeats}; {machine['cpu']}, {machine['cores']} cores\n"
    )
    print(table(results))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": machine,
                "region_mib": args.region_mib,
                "repeats": args.repeats,
                "seconds": round(time.time() - started, 1),
                "gbps": results,
                "targets": {k: {"baseline": b, "ratio": t} for k, (b, t) in TARGETS.items()},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {RESULTS} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
