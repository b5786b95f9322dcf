"""Failures on the P2P read path become misses (and a recompute), never wrong bytes, and
are counted by cause: a peer killed in the middle of a load, a corrupted transfer, a
stale directory hint."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvatlas.core.checksum import checksum
from kvatlas.wire.engine_proto import (
    CommitItem,
    LookupResult,
)
from support.wait import wait_until

from .cluster import chunk_data, cluster, prompt, wait_peers
from .test_single_machine import fetch


def test_peer_killed_mid_load_falls_back_within_a_second(tmp_path: Path) -> None:
    n = 30
    with cluster(
        tmp_path, "node-a", "node-b", extra={"node-a": ["--p2p-fault-read-delay", "0.1"]}
    ) as (coord, (a, b)):
        wait_peers([a, b])
        tokens, data = prompt(n, seed=2), chunk_data(n, 2000, seed=2)
        ca, cb = a.client(), b.client()
        assert ca.store_chunks(tokens, data).stored == n
        wait_until(lambda: coord.held(ca, tokens), lambda h: h.get("node-a") == n, what="directory")
        result: list[tuple[LookupResult, list[np.ndarray]]] = []
        done_at: list[float] = []

        def lookup() -> None:
            result.append(fetch(cb, tokens))
            done_at.append(time.monotonic())

        served = a.status()["p2p"]["served_reads"]
        t = threading.Thread(target=lookup)
        t.start()
        wait_until(
            lambda: b.status()["active_p2p_lookup_jobs"],
            lambda jobs: jobs == 1,
            what="B's load started",
            timeout=10,
        )
        wait_until(  # a few chunks in (0.1 s each)
            lambda: a.status()["p2p"]["served_reads"],
            lambda reads: reads >= served + 3,
            what="A serving its third chunk to B",
            timeout=10,
        )
        killed_at = time.monotonic()
        a.popen.send_signal(signal.SIGKILL)
        t.join(30)
        assert done_at, "B's lookup did not return"
        assert done_at[0] - killed_at < 1.0, done_at[0] - killed_at
        res, got = result[0]
        assert res.p2p_fallback == "peer_dead"
        assert 0 < res.hit_chunks < n and res.peer_chunks == res.hit_chunks
        assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=False))
        st = b.status()
        assert st["p2p"]["fallbacks"]["peer_dead"] == 1
        assert st["active_p2p_lookup_jobs"] == 0
        assert st["leases"]["write"] == 0  # slots of the failed reads were aborted


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_corrupted_transfer_is_a_miss_never_wrong_bytes(tmp_path: Path, transport: str) -> None:
    """tcp: the owner's server flips a byte of what it sends; shm: the requester's copy
    threads verify the chunks of one read in parallel, and the third is corrupted."""
    n = 5
    with cluster(
        tmp_path,
        "node-a",
        "node-b",
        transport=transport,
        extra={"node-b": ["--p2p-fault-corrupt-read", "3"]},
    ) as (coord, (a, b)):
        wait_peers([a, b])
        tokens, data = prompt(n, seed=3), chunk_data(n, 3000, seed=3)
        ca, cb = a.client(), b.client()
        assert ca.store_chunks(tokens, data).stored == n
        wait_until(lambda: coord.held(ca, tokens), lambda h: h.get("node-a") == n, what="directory")
        res, got = fetch(cb, tokens)
        assert (res.hit_chunks, res.p2p_fallback) == (2, "checksum_mismatch")
        assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=False))
        assert b.status()["p2p"]["fallbacks"]["checksum_mismatch"] == 1
        # the next lookup reads the chunk again, correctly this time
        res, got = fetch(cb, tokens)
        assert (res.hit_chunks, res.peer_chunks, res.p2p_fallback) == (n, 1, "")
        assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=True))


def test_stale_directory_hint_is_a_counted_miss(tmp_path: Path) -> None:
    n = 4
    with cluster(
        tmp_path, "node-a", "node-b", extra={"node-a": ["--event-flush-interval", "4"]}
    ) as (coord, (a, b)):
        wait_peers([a, b])
        tokens, data = prompt(n, seed=4), chunk_data(n, 3000, seed=4)
        ca, cb = a.client(), b.client()
        assert ca.store_chunks(tokens, data).stored == n
        wait_until(
            lambda: coord.held(ca, tokens),
            lambda h: h.get("node-a") == n,
            what="directory",
            timeout=10,
        )
        # A's L1 (20 MiB) evicts the prompt; its DELETEs wait for the next flush (4 s)
        filler = prompt(24, seed=5)
        for h, d in zip(ca.hashes(filler), chunk_data(24, 1 << 20, seed=5), strict=True):
            (g,) = ca.reserve([h], [d.size])  # one at a time: each can evict older ones
            assert g.status == "reserved"
            ca.view(g.offset, g.size)[:] = d
            assert ca.commit([CommitItem(h, g.lease_id, checksum(d.data))]) == [True]
        assert ca.lookup(tokens).hit_chunks == 0
        assert coord.held(ca, tokens).get("node-a") == n  # the directory still says yes
        res, _ = fetch(cb, tokens)
        assert (res.hit_chunks, res.p2p_fallback) == (0, "stale_hint")
        st = b.status()["p2p"]
        assert st["fallbacks"]["stale_hint"] == 1 and st["lock_requests"] == 1
        assert 'cause="stale_hint"' in b.metrics()
