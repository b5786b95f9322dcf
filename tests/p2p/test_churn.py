"""Peer churn: a peer that leaves is removed after 3 listings without it, one that
restarts with a new incarnation gets a rebuilt adapter, and a coordinator outage keeps
every peer (P2P keeps working with the directory unreachable: all peers are asked)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np

from .cluster import (
    HEARTBEAT_S,
    chunk_data,
    cluster,
    prompt,
    start_node,
    stop,
    wait_peers,
    wait_until,
)
from .test_single_machine import fetch


def test_peer_that_leaves_is_removed_after_three_listings(tmp_path: Path) -> None:
    with cluster(tmp_path, "node-a", "node-b") as (coord, (a, b)):
        wait_peers([a, b])
        a.proc.send_signal(signal.SIGTERM)  # deregisters on its way out
        wait_until(
            lambda: "node-a" not in {i["instance_id"] for i in coord.instances()}, 10, "left"
        )
        left = time.monotonic()
        wait_until(lambda: b.peers() == [], 10, "node-a removed")
        took = time.monotonic() - left
        # the 3rd listing without it, not the 1st: at least 2 poll intervals later
        assert took >= 1.5 * HEARTBEAT_S, took
        # Its own exit after that one SIGTERM: stop() would signal a process still in
        # interpreter shutdown again, and the default handler is back by then.
        assert a.proc.wait(20) == 0
        assert a.stop() == 0
        st = b.status()
        assert st["p2p_peer_count"] == 0 and st["p2p"]["adapters_removed"] == 1
        assert "Removed P2P adapter for peer node-a" in b.log.read_text()


def test_restarted_peer_gets_a_rebuilt_adapter(tmp_path: Path) -> None:
    with cluster(tmp_path, "node-a", "node-b") as (coord, (a, b)):
        wait_peers([a, b])
        old = {i["instance_id"]: i for i in coord.instances()}["node-a"]
        a.stop(signal.SIGKILL)  # no deregistration: the coordinator still lists it
        a2 = start_node(tmp_path, "node-a", coord)
        try:
            new = {i["instance_id"]: i for i in coord.instances()}["node-a"]
            wait_until(
                lambda: (
                    {i["instance_id"]: i for i in coord.instances()}["node-a"]["incarnation"]
                    > old["incarnation"]
                ),
                10,
                "re-registration",
            )
            wait_until(lambda: b.status()["p2p"]["adapters_rebuilt"] >= 1, 10, "rebuild")
            new = {i["instance_id"]: i for i in coord.instances()}["node-a"]
            assert new["p2p_advertised_url"] != old["p2p_advertised_url"]
            assert b.peers() == ["node-a"]
            # the rebuilt adapter reaches the new process
            tokens, data = prompt(3, seed=6), chunk_data(3, 2000, seed=6)
            ca, cb = a2.client(), b.client()
            assert ca.store_chunks(tokens, data).stored == 3
            wait_until(lambda: coord.held(ca, tokens).get("node-a") == 3, what="directory")
            res, got = fetch(cb, tokens)
            assert (res.hit_chunks, res.peer_chunks) == (3, 3)
            assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=True))
        finally:
            a2.stop()


def test_coordinator_outage_keeps_peers_and_p2p_works(tmp_path: Path) -> None:
    with cluster(tmp_path, "node-a", "node-b") as (coord, (a, b)):
        wait_peers([a, b])
        assert stop(coord.proc) == 0
        wait_until(lambda: b.status()["p2p_state"] == "disconnected", 10, "disconnected")
        time.sleep(5 * HEARTBEAT_S)  # well over 3 failed polls
        assert b.peers() == ["node-a"] and a.peers() == ["node-b"]
        tokens, data = prompt(4, seed=7), chunk_data(4, 2500, seed=7)
        ca, cb = a.client(), b.client()
        assert ca.store_chunks(tokens, data).stored == 4
        res, got = fetch(cb, tokens)
        assert (res.hit_chunks, res.peer_chunks, res.p2p_fallback) == (4, 4, "")
        assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=True))
        st = b.status()["p2p"]
        assert st["directory_failures"] >= 1 and st["all_peer_fallbacks"] >= 1
