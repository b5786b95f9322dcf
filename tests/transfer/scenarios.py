"""The conformance scenarios, one function per behaviour, each taking a transport name.

test_conformance.py calls them in-process, or (for transports in NETNS_TRANSPORTS) runs

    python -m transfer.scenarios SCENARIO ENGINE

inside a private network namespace, where they run unchanged. Every owner is a real
second process (``harness.OwnerProcess``), every requester region a real L1 region.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvatlas.core.checksum import checksum
from kvatlas.runtime.region import L1Region
from kvatlas.transfer.base import (
    Endpoint,
    FaultPlan,
    ReadOp,
    ReadResult,
    TransferClient,
)
from kvatlas.transfer.factory import make_transport
from support.wait import wait_until
from transfer.harness import OwnerProcess, pattern

KiB, MiB = 1 << 10, 1 << 20
REGION = 32 * MiB
PEER = "node-b"
LEASE = "lease-1"
ALL = (PEER, LEASE, 0, REGION)
"""A lease over the whole region: what the scenarios that are not about leases use."""

EXPECTED = pattern(REGION)


def hang_guard(deadline_s: float) -> float:
    """How long a read with ``deadline_s`` may take before the scenario calls it hung.
    Which deadline fired is the statuses' to show (``timeout``, ``peer_dead``); a read
    that ignored its deadline waits on a dead or stopped peer forever, so the guard can
    be generous: a loaded 2-core machine may add seconds to a deadline."""
    return 5 * deadline_s + 2.0


def op(remote: int, size: int, local: int, lease: str = LEASE) -> ReadOp:
    return ReadOp(remote, size, local, lease, checksum(EXPECTED[remote : remote + size].data))


@contextmanager
def requester(
    transport: str, token: str | None = None, faults: FaultPlan | None = None
) -> Iterator[tuple[L1Region, TransferClient]]:
    with L1Region.create(REGION, "requester") as local:
        client = make_transport(transport).client(local, PEER, token=token, faults=faults)
        try:
            yield local, client
        finally:
            client.close()


def statuses(results: list[ReadResult]) -> list[str]:
    return [r.status.value for r in results]


def landed(local: L1Region, o: ReadOp) -> bool:
    return bytes(local.buffer[o.local_offset : o.local_offset + o.size]) == bytes(
        EXPECTED[o.remote_offset : o.remote_offset + o.size]
    )


# ------------------------------------------------------------------------------ scenarios


def roundtrip(transport: str) -> None:
    """4 KiB, 256 KiB and 4 MiB chunks, singly and many in one call; bytes identical,
    checksums ok, the owner's region untouched."""
    with OwnerProcess(transport, REGION, leases=[ALL]) as owner, requester(transport) as (local, c):
        before = owner.region_checksum()
        peer = c.connect(owner.endpoint)
        ops: list[ReadOp] = []
        local_at = 0
        for size, count, stride in (
            (4 * KiB, 16, 12_288),
            (256 * KiB, 8, 3 * MiB),
            (4 * MiB, 4, 5 * MiB),
        ):
            for k in range(count):
                ops.append(op((k * stride + 4 * KiB * k) % (REGION - size), size, local_at))
                local_at += size
        for o in (ops[0], ops[16], ops[24]):  # one op of each size on its own
            assert statuses(peer.read([o], 10.0)) == ["ok"]
            assert landed(local, o)
        local.array[:] = 0
        results = peer.read(ops, 10.0)
        assert statuses(results) == ["ok"] * len(ops), results
        assert all(landed(local, o) for o in ops)
        assert c.stats.bytes_ok == sum(o.size for o in ops) + 4 * KiB + 256 * KiB + 4 * MiB
        # Again on the same connection (tcp pools it).
        assert statuses(peer.read(ops[:4], 10.0)) == ["ok"] * 4
        assert owner.region_checksum() == before, "the requester wrote into the owner"
        peer.close()


def outside_lease(transport: str) -> None:
    """tcp: the owner refuses ranges no live lease of this peer covers, per op. One-sided
    transports: only the region boundary is enforced (documented in transfer.base)."""
    lease = (PEER, LEASE, 1 * MiB, 1 * MiB)
    with OwnerProcess(transport, REGION, leases=[lease]) as owner, requester(transport) as (_, c):
        peer = c.connect(owner.endpoint)
        inside = op(1 * MiB, 64 * KiB, 0)
        outside = op(4 * MiB, 64 * KiB, 64 * KiB)
        wrong_lease = op(1 * MiB, 64 * KiB, 128 * KiB, lease="lease-other")
        straddling = op(2 * MiB - 4 * KiB, 64 * KiB, 192 * KiB)
        beyond_region = ReadOp(REGION - 4 * KiB, 64 * KiB, 256 * KiB, LEASE, 0)
        results = peer.read([inside, outside, wrong_lease, straddling, beyond_region], 5.0)
        got = statuses(results)
        assert got[0] == "ok" and got[4] == "refused", results
        if make_transport(transport).enforces_leases:
            assert got[1:4] == ["refused"] * 3, results
            assert "lease" in results[1].detail
        else:
            # Not enforced by a one-sided transport: the control plane never hands out such
            # ranges, and the checksum is what a reader relies on.
            assert got[1:4] == ["ok"] * 3, results


def corrupted(transport: str) -> None:
    """A corrupted transfer is reported as checksum_mismatch, never ok."""
    server_side = make_transport(transport).enforces_leases  # tcp corrupts what the owner sends
    with (
        OwnerProcess(
            transport, REGION, leases=[ALL], corrupt_read=2 if server_side else None
        ) as owner,
        requester(transport, faults=None if server_side else FaultPlan(corrupt_read=2)) as (
            local,
            c,
        ),
    ):
        peer = c.connect(owner.endpoint)
        ops = [op(i * MiB, 256 * KiB, i * MiB) for i in range(3)]
        results = peer.read(ops, 5.0)
        assert statuses(results) == ["ok", "checksum_mismatch", "ok"], results
        assert not landed(local, ops[1]) and landed(local, ops[0]) and landed(local, ops[2])
        assert c.stats.ops["checksum_mismatch"] == 1


def peer_killed(transport: str) -> None:
    """The owner is SIGKILLed mid-read: the read ends in failures (its death seen, or
    its deadline), not a hang; so does a read after its death."""
    deadline_s = 5.0
    with OwnerProcess(transport, REGION, leases=[ALL]) as owner, requester(transport) as (local, c):
        peer = c.connect(owner.endpoint)
        assert statuses(peer.read([op(0, 4 * KiB, 0)], 5.0)) == ["ok"]  # connected, warm
        # 4 GiB through 8 local slots. Ops that share a slot also share their source, so
        # that two of them landing at once (a copy thread that fell 8 ops behind the
        # other) write the same bytes and still match their checksum.
        ops = [op((i % 8 % 7) * 4 * MiB, 4 * MiB, (i % 8) * 4 * MiB) for i in range(1024)]
        out: list[list[ReadResult]] = []
        started = time.monotonic()
        reader = threading.Thread(target=lambda: out.append(peer.read(ops, deadline_s)))
        reader.start()
        # mid-read: the first op's bytes (beyond the warm-up's 4 KiB) are landing
        wait_until(
            lambda: bool(local.array[4 * KiB : 4 * MiB].any()),
            what="the first bytes of the 4 GiB read in the requester's region",
            timeout=deadline_s,
            every=0.002,
        )
        owner.kill()
        reader.join(hang_guard(deadline_s))
        elapsed = time.monotonic() - started
        assert not reader.is_alive() and elapsed < hang_guard(deadline_s), elapsed
        got = statuses(out[0])
        assert set(got) <= {"ok", "peer_dead", "timeout"}, sorted(set(got))
        assert got.count("ok") < len(ops), "the whole 4 GiB read finished before the kill"
        # And a read after the death fails fast as well.
        started = time.monotonic()
        after = statuses(peer.read(ops[:4], 2.0))
        assert set(after) <= {"peer_dead", "timeout"}, after
        assert time.monotonic() - started < hang_guard(2.0)
        assert peer.drain(10.0)


def owner_stopped(transport: str) -> None:
    """The owner hangs (SIGSTOP): the read returns, its deadline fired: ops either
    landed (one-sided transports need no owner CPU) or timed out."""
    deadline_s = 1.0
    with OwnerProcess(transport, REGION, leases=[ALL]) as owner, requester(transport) as (local, c):
        peer = c.connect(owner.endpoint)
        assert statuses(peer.read([op(0, 4 * KiB, 0)], 5.0)) == ["ok"]
        os.kill(owner.pid, signal.SIGSTOP)
        try:
            ops = [op(i * MiB, MiB, i * MiB) for i in range(16)]
            started = time.monotonic()
            results = peer.read(ops, deadline_s)
            assert time.monotonic() - started < hang_guard(deadline_s)
            assert set(statuses(results)) <= {"ok", "timeout"}, results
            assert all(landed(local, r.op) for r in results if r.ok)
        finally:
            owner.kill()  # a transfer still waiting on the stopped owner now fails
        assert peer.drain(15.0), "an abandoned transfer still runs"


def silent_peer(transport: str) -> None:
    """tcp: a peer that accepts but never answers gives timeouts: the deadline fired."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    endpoint_url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    endpoint = Endpoint(transport=transport, url=endpoint_url, region_size=REGION)
    try:
        with requester(transport) as (_, c):
            peer = c.connect(endpoint)
            started = time.monotonic()
            results = peer.read([op(0, 64 * KiB, 0), op(MiB, 64 * KiB, MiB)], 0.5)
            elapsed = time.monotonic() - started
            assert statuses(results) == ["timeout", "timeout"], results
            assert elapsed < hang_guard(0.5), elapsed
    finally:
        listener.close()
        for s in accepted:
            s.close()


def bad_token(transport: str) -> None:
    """tcp: a wrong, missing or non-ASCII token is refused; the right one reads."""
    with OwnerProcess(transport, REGION, leases=[ALL], token="s3cret") as owner:
        for token, expected in (
            ("wrong", "refused"),
            (None, "refused"),
            ("é", "refused"),
            ("s3cret", "ok"),
        ):
            with requester(transport, token=token) as (_, c):
                results = c.connect(owner.endpoint).read([op(0, 4 * KiB, 0)], 5.0)
                assert statuses(results) == [expected], (token, results)
                if expected == "refused":
                    assert "token" in results[0].detail


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(transport: str) -> None:
    """Neither an idle owner nor an idle connected requester spins a core (NIXL's own
    progress thread would: ~99% of one)."""
    with OwnerProcess(transport, REGION, leases=[ALL]) as owner, requester(transport) as (_, c):
        peer = c.connect(owner.endpoint)
        assert statuses(peer.read([op(0, 4 * KiB, 0)], 5.0)) == ["ok"]
        # Not synchronisation: idleness is what is measured, and it starts with a moment
        # in which nothing is asked of either side (the warm-up read's tail excluded).
        time.sleep(0.2)
        owner_before, mine_before, t0 = (
            _cpu_seconds(owner.pid),
            _cpu_seconds(os.getpid()),
            time.monotonic(),
        )
        time.sleep(1.5)  # the idle window whose CPU time is measured
        elapsed = time.monotonic() - t0
        owner_pct = 100 * (_cpu_seconds(owner.pid) - owner_before) / elapsed
        mine_pct = 100 * (_cpu_seconds(os.getpid()) - mine_before) / elapsed
        print(f"idle cpu {transport}: owner {owner_pct:.1f}% requester {mine_pct:.1f}%")
        assert owner_pct < 10 and mine_pct < 10, (owner_pct, mine_pct)


SCENARIOS: dict[str, Callable[[str], None]] = {
    f.__name__: f
    for f in (
        roundtrip,
        outside_lease,
        corrupted,
        peer_killed,
        owner_stopped,
        idle_cpu,
        silent_peer,
        bad_token,
    )
}
TCP_ONLY = frozenset({"silent_peer", "bad_token"})


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](sys.argv[2])
    print("PASSED", flush=True)
