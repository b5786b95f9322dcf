"""Peer churn: a peer that leaves is removed after 3 listings without it, one that
restarts with a new incarnation gets a rebuilt adapter, and a coordinator outage keeps
every peer (P2P keeps working with the directory unreachable: all peers are asked)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np

from support.wait import wait_until

from .cluster import HEARTBEAT_S, chunk_data, cluster, prompt, start_node, wait_peers
from .test_single_machine import fetch


def test_peer_that_leaves_is_removed_after_three_listings(tmp_path: Path) -> None:
    with cluster(tmp_path, "node-a", "node-b") as (coord, (a, b)):
        wait_peers([a, b])
        a.popen.send_signal(signal.SIGTERM)  # deregisters on its way out
        wait_until(
            lambda: {i["instance_id"] for i in coord.instances()},
            lambda ids: "node-a" not in ids,
            what="node-a deregistered",
            timeout=10,
        )
        left = time.monotonic()
        wait_until(b.peers, lambda ps: ps == [], what="node-a removed from B's peers", timeout=10)
        took = time.monotonic() - left
        # the 3rd listing without it, not the 1st: at least 2 poll intervals later
        assert took >= 1.5 * HEARTBEAT_S, took
        # Its own exit after that one SIGTERM: stop() would signal a process still in
        # interpreter shutdown again, and the default handler is back by then.
        assert a.wait_exit(20) == 0
        assert a.stop() == 0
        st = b.status()
        assert st["p2p_peer_count"] == 0 and st["p2p"]["adapters_removed"] == 1
        assert "Removed P2P adapter for peer node-a" in b.text()


def test_restarted_peer_gets_a_rebuilt_adapter(tmp_path: Path) -> None:
    with cluster(tmp_path, "node-a", "node-b") as (coord, (a, b)):
        wait_peers([a, b])
        old = {i["instance_id"]: i for i in coord.instances()}["node-a"]
        a.stop(signal.SIGKILL)  # no deregistration: the coordinator still lists it
        a2 = start_node(tmp_path, "node-a", coord)
        try:
            new = {i["instance_id"]: i for i in coord.instances()}["node-a"]
            wait_until(
                lambda: {i["instance_id"]: i for i in coord.instances()}["node-a"]["incarnation"],
                lambda inc: inc > old["incarnation"],
                what="node-a re-registered with a new incarnation",
                timeout=10,
            )
            wait_until(
                lambda: b.status()["p2p"]["adapters_rebuilt"],
                lambda n: n >= 1,
                what="B rebuilt node-a's adapter",
                timeout=10,
            )
            new = {i["instance_id"]: i for i in coord.instances()}["node-a"]
            assert new["p2p_advertised_url"] != old["p2p_advertised_url"]
            assert b.peers() == ["node-a"]
            # the rebuilt adapter reaches the new process
            tokens, data = prompt(3, seed=6), chunk_data(3, 2000, seed=6)
            ca, cb = a2.client(), b.client()
            assert ca.store_chunks(tokens, data).stored == 3
            wait_until(
                lambda: coord.held(ca, tokens), lambda h: h.get("node-a") == 3, what="directory"
            )
            res, got = fetch(cb, tokens)
            assert (res.hit_chunks, res.peer_chunks) == (3, 3)
            assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=True))
        finally:
            a2.stop()


def test_coordinator_outage_keeps_peers_and_p2p_works(tmp_path: Path) -> None:
    with cluster(tmp_path, "node-a", "node-b") as (coord, (a, b)):
        wait_peers([a, b])
        assert coord.stop() == 0
        wait_until(
            lambda: b.status()["p2p_state"], lambda st: st == "disconnected", what="B disconnected"
        )
        failed = b.status()["p2p"]["poll_failures"]
        wait_until(  # well over 3 failed polls
            lambda: b.status()["p2p"]["poll_failures"],
            lambda n: n >= failed + 5,
            what="five more failed peer listings on B",
            timeout=10,
        )
        assert b.peers() == ["node-a"] and a.peers() == ["node-b"]
        tokens, data = prompt(4, seed=7), chunk_data(4, 2500, seed=7)
        ca, cb = a.client(), b.client()
        assert ca.store_chunks(tokens, data).stored == 4
        res, got = fetch(cb, tokens)
        assert (res.hit_chunks, res.peer_chunks, res.p2p_fallback) == (4, 4, "")
        assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=True))
        st = b.status()["p2p"]
        assert st["directory_failures"] >= 1 and st["all_peer_fallbacks"] >= 1
