"""A frozen peer costs one short lock deadline, once, for all lookups together,
and a slow but answering one is still read from; the server learns an
engine's prefill rate for lookups that carry no estimate. Real processes: a
coordinator and two servers with tcp P2P; the peer is frozen with SIGSTOP. The one
wall-clock bound tells the short deadline from the bug's (10 s: 2,048 tokens x the 5 ms
default recompute rate) at half of it; the rest is read from the server's state. The
speed targets are measured by ``kvatlas bench faults --faults frozen_peer_no_estimate``."""

from __future__ import annotations

import signal
import threading
from functools import partial
from pathlib import Path

import numpy as np

from kvatlas.wire.engine_proto import Lookup, LookupResult
from support.wait import wait_until

from .cluster import CHUNK, chunk_data, cluster, prompt, wait_peers
from .test_fail_fast import p2p, timed
from .test_single_machine import fetch

BIG = 2048 // CHUNK
"""Chunks of a 2,048-token prefix."""
BUG_S = 2048 * 0.005
"""What a lookup of it waited on a frozen peer before the short lock deadline: the
prefix's recompute estimate at the default 5 ms a token."""


def test_frozen_peer_without_estimate_costs_one_short_lock_deadline(tmp_path: Path) -> None:
    with cluster(tmp_path, "node-a", "node-b") as (coord, (a, b)):
        wait_peers([a, b])
        ca, cb = a.client(), b.client()
        held = prompt(BIG, seed=61)
        assert ca.store_chunks(held, chunk_data(BIG, 512, seed=61)).stored == BIG
        wait_until(lambda: coord.held(ca, held).get("node-a") == BIG, what="directory")
        others = [b.client() for _ in range(3)]
        a.popen.send_signal(signal.SIGSTOP)
        try:
            outs: list[tuple[str, float]] = []
            start = threading.Barrier(4)

            def need_a(c: object) -> None:
                start.wait()
                r, t = timed(lambda: c.lookup(held))  # type: ignore[attr-defined]
                outs.append((r.p2p_fallback, t))

            threads = [threading.Thread(target=need_a, args=(c,)) for c in others]
            for t in threads:
                t.start()
            start.wait()
            (res, _), first = timed(lambda: fetch(cb, held))
            for t in threads:
                t.join(15)
            # one lock deadline (the 0.1 s prior: B never heard from A), not 10 s
            assert res.hit_chunks == 0 and res.p2p_fallback == "timeout", res
            assert first < BUG_S / 2, first
            # the lookups in flight together ended with it, none waited a deadline more
            assert len(outs) == 3 and all(t < BUG_S / 2 for _, t in outs), outs
            assert {f for f, _ in outs} <= {"timeout", "cooling_off"}, outs
            st = p2p(b)
            assert st["cooling_peers"] == ["node-a"] and st["breakers_opened"] == 1, st
            locks, dirs = st["lock_requests"], st["directory_lookups"]
            for _ in range(5):
                res, _ = fetch(cb, held)
                assert res.p2p_fallback == "cooling_off", res
            st = p2p(b)
            # its only peer is down: neither the peer nor the directory is asked
            assert (st["lock_requests"], st["directory_lookups"]) == (locks, dirs), st
            assert st["lock_deadline_prior_ms"] == 100.0
            (timing,) = [t for t in st["peer_timings"] if t["peer"] == "node-a"]
            assert 0 < timing["last_lock_deadline_ms"] <= 100.0, timing
            assert b.status()["lookups"]["flag_estimates"] >= 1
            assert (
                'kvatlas_server_p2p_lock_deadline_seconds{instance_id="node-b",peer="node-a"}'
                in (b.metrics())
            )
        finally:
            a.popen.send_signal(signal.SIGCONT)
        wait_until(
            lambda: p2p(b)["cooling_peers"] == [], timeout=10, what="breaker closed by a probe"
        )
        # A is read again (a busy machine may make one lock RPC late and the breaker open
        # again until the next probe: retried, not assumed)
        res, got = wait_until(
            lambda: fetch(cb, held),
            lambda r: r[0].peer_chunks == BIG,
            timeout=10,
            every=0.2,
            what="the prefix read from A after SIGCONT",
        )
        assert (res.hit_chunks, res.peer_chunks, res.p2p_fallback) == (BIG, BIG, "")
        want = chunk_data(BIG, 512, seed=61)
        assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
        # A answered: its lock deadline is now learned from its round trips
        (timing,) = [t for t in p2p(b)["peer_timings"] if t["peer"] == "node-a"]
        assert timing["rpc_samples"] >= 1 and timing["bandwidth_mib_s"] > 0, timing


def test_slow_peer_is_still_read_under_a_learned_engine_rate(tmp_path: Path) -> None:
    n = 4
    with cluster(
        tmp_path, "node-a", "node-b", extra={"node-a": ["--p2p-fault-read-delay", "0.3"]}
    ) as (coord, (a, b)):
        wait_peers([a, b])
        ca, cb = a.client(), b.client()
        assert cb.ns is not None
        # B's engine reports its prefill rate once (50 ms/token: 64 tokens take 3.2 s)
        body = cb.call(
            Lookup(cb.ns, hashes=list(cb.hashes(prompt(n, seed=70))), prefill_s_per_token=0.05),
            timeout_s=30,
        )
        assert isinstance(body, LookupResult)
        assert b.status()["lookups"]["recompute_s_per_token"] == {"tiny": 0.05}
        for seed in (71, 72):
            slow = prompt(n, seed=seed)
            assert ca.store_chunks(slow, chunk_data(n, 2000, seed=seed)).stored == n
            wait_until(
                partial(coord.held, ca, slow),
                lambda held: held.get("node-a") == n,
                what="directory",
            )
            # no estimate on this lookup: the learned 3.2 s bounds it, not the flags'
            # 0.32 s, and the lock deadline (a fast RPC) does not cut the slow load
            (res, got), took = timed(partial(fetch, cb, slow))
            assert (res.hit_chunks, res.peer_chunks, res.p2p_fallback) == (n, n, ""), res
            want = chunk_data(n, 2000, seed=seed)
            assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
            assert took >= 0.3, took
        st = b.status()
        assert st["lookups"]["learned_estimates"] >= 2
        assert st["p2p"]["cooling_peers"] == []
        (timing,) = [t for t in st["p2p"]["peer_timings"] if t["peer"] == "node-a"]
        # the second load's deadline came from A's observed (slow) bandwidth
        assert timing["bandwidth_mib_s"] > 0 and timing["last_load_deadline_ms"] > 300, timing
        assert timing["lock_deadline_ms"] < 1000, timing


def test_a_peer_promoting_from_l2_gets_the_lookups_time_not_the_short_deadline(
    tmp_path: Path,
) -> None:
    size = 1 << 20  # A's 10 MiB of L1 holds fewer than 10 chunks of 1 MiB
    n = 16
    l2 = ["--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.1"]
    with cluster(tmp_path, "node-a", "node-b", extra={"node-a": l2}, l1_gb=0.01) as (
        coord,
        (a, b),
    ):
        wait_peers([a, b])
        ca, cb = a.client(), b.client()
        tokens = prompt(n, seed=81)
        data = chunk_data(n, size, seed=81)
        for i in range(n):  # one at a time: the first ones go to L2 to make room
            stored = ca.store_chunks(tokens[: (i + 1) * CHUNK], [data[i]], first_chunk=i)
            assert stored.stored == 1, (i, stored)
        assert a.status()["l2"]["demotions"] > 0
        first = tokens[: 2 * CHUNK]
        wait_until(lambda: coord.held(ca, first).get("node-a") == 2, what="directory")
        before = p2p(b)
        (res, got), _ = timed(lambda: fetch(cb, first))
        assert (res.hit_chunks, res.peer_chunks, res.p2p_fallback) == (2, 2, ""), res
        assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=False))
        st = p2p(b)
        assert st["promoting_locks"] == before["promoting_locks"] + 1, st
        # its round trip (a disk read) is no sample of A's RPC time
        (timing,) = [t for t in st["peer_timings"] if t["peer"] == "node-a"]
        assert timing["rpc_samples"] == 1, timing  # the unlock only
