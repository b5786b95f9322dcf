"""No lookup waits on a dead, frozen or busy peer, on real
processes: the directory's "nobody holds it" asks no peer, a dead peer fails at once and
its breaker opens, a frozen one costs one bounded deadline (the server's own recompute
estimate, not the 30 s timeout) and is probed back after SIGCONT, and local work never
queues behind lookups that wait on peers. What each case proves is read from the
servers' state (who was asked, why a lookup fell back, what was still in flight when
local work ended), not from how fast it ran; the one wall-clock bound tells the frozen
peer's deadline from the 30 s timeout, at half of it. The speed of these paths is the
benchmarks'."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from kvatlas.connector.client import CacheClient
from kvatlas.wire.engine_proto import Lookup, LookupResult
from support.wait import wait_until

from .cluster import Node, chunk_data, cluster, prompt, wait_peers
from .test_single_machine import fetch

T = TypeVar("T")
N = 4  # chunks of 16 tokens: the default 5 ms/token recompute bounds a wait at 0.32 s
LOOKUP_TIMEOUT_S = 30.0
"""The servers' --p2p-lookup-timeout (its default), which a bounded deadline must beat."""
COORDINATOR_TIMEOUT_S = 20.0
"""Node B's --coordinator-timeout in the frozen coordinator case: what a lookup asking
the directory would wait without --p2p-directory-timeout (75 ms)."""


def timed(f: Callable[[], T]) -> tuple[T, float]:
    t0 = time.monotonic()
    out = f()
    return out, time.monotonic() - t0


def p2p(node: Node) -> dict[str, Any]:
    return dict(node.status()["p2p"])


def seed_a(coord_held: Callable[..., dict[str, int]], ca: CacheClient, seed: int) -> list[int]:
    tokens = prompt(N, seed=seed)
    assert ca.store_chunks(tokens, chunk_data(N, 2000, seed=seed)).stored == N
    wait_until(lambda: coord_held(ca, tokens).get("node-a") == N, what="directory")
    return tokens


def test_dead_peer_costs_no_lookup_its_time(tmp_path: Path) -> None:
    with cluster(tmp_path, "node-a", "node-b") as (coord, (a, b)):
        wait_peers([a, b])
        ca, cb = a.client(), b.client()
        held = seed_a(coord.held, ca, seed=11)
        local = prompt(N, seed=12)
        assert cb.store_chunks(local, chunk_data(N, 2000, seed=12)).stored == N
        a.popen.send_signal(signal.SIGKILL)
        a.popen.wait(10)
        before = p2p(b)
        # a prompt nobody holds: the directory says so, and no peer is asked
        res = cb.lookup(prompt(N, seed=13))
        assert res.hit_chunks == 0
        after = p2p(b)
        assert after["lock_requests"] == before["lock_requests"]
        assert after["no_holder"] == before["no_holder"] + 1
        # the dead holder: refused at once (socket monitor), then skipped (breaker open)
        res, _ = fetch(cb, held)
        assert res.hit_chunks == 0 and res.p2p_fallback == "peer_dead", res
        assert p2p(b)["cooling_peers"] == ["node-a"]
        # lookups that need A, in flight together, and a local hit meanwhile
        outs: list[str] = []

        def need_a() -> None:
            outs.append(cb.lookup(held).p2p_fallback)

        threads = [threading.Thread(target=need_a) for _ in range(6)]
        for t in threads:
            t.start()
        res = cb.lookup(local)
        for t in threads:
            t.join(10)
        assert res.hit_chunks == N
        # none asked the dead peer (the lock requests below): each fell back at once
        assert len(outs) == 6 and set(outs) <= {"cooling_off", "busy"}, outs
        assert p2p(b)["lock_requests"] == after["lock_requests"] + 1


def test_frozen_peer_costs_one_bounded_deadline_then_is_probed_back(tmp_path: Path) -> None:
    with cluster(tmp_path, "node-a", "node-b") as (coord, (a, b)):
        wait_peers([a, b])
        ca, cb = a.client(), b.client()
        held = seed_a(coord.held, ca, seed=21)
        a.popen.send_signal(signal.SIGSTOP)
        try:
            (res, _), took = timed(lambda: fetch(cb, held))
            # one deadline: 64 tokens x 5 ms = 0.32 s, not --p2p-lookup-timeout's 30 s
            assert res.hit_chunks == 0 and res.p2p_fallback == "timeout", res
            assert took < LOOKUP_TIMEOUT_S / 2, took
            locks = p2p(b)["lock_requests"]
            for _ in range(3):
                res, _ = fetch(cb, held)
                assert res.p2p_fallback == "cooling_off", res
            st = p2p(b)
            assert st["lock_requests"] == locks and st["cooling_peers"] == ["node-a"]
            assert st["breakers_opened"] == 1
        finally:
            a.popen.send_signal(signal.SIGCONT)
        # a probe answered: A is used again, well before the 10 s cool-off (half of it)
        wait_until(
            lambda: p2p(b)["cooling_peers"] == [], timeout=5, what="breaker closed by a probe"
        )
        res, got = fetch(cb, held)
        assert (res.hit_chunks, res.peer_chunks, res.p2p_fallback) == (N, N, "")
        want = chunk_data(N, 2000, seed=21)
        assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
        assert p2p(b)["probes"] >= 1


@pytest.mark.slow  # 9 to 11 s measured on the 2-core VM
def test_local_work_never_waits_behind_peer_fetches(tmp_path: Path) -> None:
    n = 10
    with cluster(
        tmp_path,
        "node-a",
        "node-b",
        extra={
            "node-a": ["--p2p-fault-read-delay", "0.3"],
            "node-b": ["--engine-p2p-workers", "2"],
        },
    ) as (coord, (a, b)):
        wait_peers([a, b])
        ca = a.client()
        cb = b.client()
        slows = [prompt(n, seed=31), prompt(n, seed=34), prompt(n, seed=35)]
        for slow in slows:
            assert ca.store_chunks(slow, chunk_data(n, 2000, seed=slow[0])).stored == n
            wait_until(
                partial(coord.held, ca, slow),
                lambda held: held.get("node-a") == n,
                what="directory",
            )
        local = prompt(N, seed=32)
        assert cb.store_chunks(local, chunk_data(N, 2000, seed=32)).stored == N
        assert cb.ns is not None
        ns = cb.ns
        results: list[LookupResult] = []

        def wait_on_a(slow: list[int]) -> None:
            # ~3 s on A's slow reads: the engine says recompute would take 20 s
            with b.client() as c:
                req = Lookup(ns, hashes=list(c.hashes(slow)), recompute_s=20.0)
                body = c.call(req, timeout_s=30)
                assert isinstance(body, LookupResult)
                results.append(body)

        threads = [threading.Thread(target=wait_on_a, args=(s,)) for s in slows[:2]]
        for t in threads:
            t.start()
        wait_until(
            lambda: b.status()["active_p2p_lookup_jobs"] == 2, timeout=10, what="both in flight"
        )
        try:
            # every P2P slot is busy (each job ~3 s on A's slow reads): local hits,
            # stores, reserves and releases all end while both are still in flight
            res = cb.lookup(local, acquire=True)
            assert res.hit_chunks == N
            assert cb.release([c.lease_id for c in res.chunks]) == N
            more = prompt(2, seed=33)
            assert cb.store_chunks(more, chunk_data(2, 2000, seed=33)).stored == 2
            # and a third lookup that would need A answers its local prefix, not waits
            res = cb.lookup(slows[2])
            assert (res.hit_chunks, res.p2p_fallback) == (0, "busy")
            assert b.status()["active_p2p_lookup_jobs"] == 2, "local work waited on them"
            assert not results, "a job that waits on A ended before the local work"
        finally:
            for t in threads:
                t.join(30)
        assert len(results) == 2 and all(r.hit_chunks == n for r in results), results
        assert p2p(b)["fallbacks"]["busy"] == 1


@pytest.mark.slow  # 10 s measured in `make test-fast` on the 2-core VM
def test_frozen_coordinator_costs_a_local_miss_one_short_wait(tmp_path: Path) -> None:
    slow = {"node-b": ["--coordinator-timeout", str(COORDINATOR_TIMEOUT_S)]}
    with cluster(tmp_path, "node-a", "node-b", extra=slow) as (coord, (a, b)):
        wait_peers([a, b])
        cb = b.client()
        before = p2p(b)
        coord.popen.send_signal(signal.SIGSTOP)
        try:
            took = [timed(partial(cb.lookup, prompt(N, seed=s)))[1] for s in range(41, 46)]
            # the first waits --p2p-directory-timeout (75 ms), not the coordinator timeout;
            # the rest do not ask the frozen directory at all, only a peer, briefly
            mid = p2p(b)
            assert mid["directory_failures"] == before["directory_failures"] + 1, mid
            assert mid["directory_lookups"] == before["directory_lookups"] + 1, mid
            assert max(took) < COORDINATOR_TIMEOUT_S / 2, took
        finally:
            coord.popen.send_signal(signal.SIGCONT)
        # the next peer listing that succeeds puts the directory back in use
        wait_until(
            lambda: (cb.lookup(prompt(N, seed=47)), p2p(b))[1],
            lambda st: st["no_holder"] > mid["no_holder"],
            timeout=10,
            what="the directory asked again after SIGCONT",
        )
