"""A fleet upgraded one node at a time: a coordinator and two `kvatlas server` processes on
127.0.0.1 with tcp P2P, one of today's and one of the first release's wire
(``v1_node.py``: today's server with `support.frozen_wire_v1` in place of its wire
modules and the first release's version handling).

KV is shared both ways over P2P with the bytes equal: today's node asks the old one in
its own version, is refused with the old bare ``version`` error, moves to 1 and keeps it;
the old node asks in 1 and is answered in 1. Each node's engine is today's CacheClient
(against the old server it moves to 1 as well), and an engine of the first release (the
frozen engine protocol over a raw socket) is served by today's server in 1, reading the
bytes out of the region it maps.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np
import zmq

from kvatlas.core.keys import default_kv_rank
from kvatlas.launch.procs import HOST, free_ports
from kvatlas.runtime.region import L1Region
from p2p.cluster import (
    CHUNK,
    HEARTBEAT_S,
    MODEL,
    Coordinator,
    Node,
    chunk_data,
    prompt,
    start_coordinator,
    start_node,
    wait_peers,
)
from p2p.test_single_machine import fetch
from support.frozen_wire_v1 import engine_proto as v1_engine
from support.frozen_wire_v1 import shapes as v1
from support.launch import launch
from support.wait import wait_until

V1_NODE = Path(__file__).with_name("v1_node.py")
N = 4
SIZE = 3000


def holds_all(node: str, held: dict[str, int]) -> bool:
    return held.get(node) == N


def start_v1_node(tmp: Path, instance_id: str, coord: Coordinator) -> Node:
    """`p2p.cluster.start_node`'s server, started through ``v1_node.py``."""
    port, http_port, p2p_port = free_ports(3)
    argv = [
        sys.executable, str(V1_NODE),
        "--host", HOST, "--port", str(port), "--http-port", str(http_port),
        "--instance-id", instance_id, "--state-dir", str(tmp / "state"),
        "--l1-size-gb", "0.02", "--chunk-size", str(CHUNK), "--engine-workers", "2",
        "--coordinator-heartbeat-interval", str(HEARTBEAT_S), "--event-flush-interval", "0.1",
        "--coordinator-timeout", "1", "--log-level", "DEBUG", "--coordinator-url", coord.url,
        "--p2p-advertise-url", f"127.0.0.1:{p2p_port}", "--p2p-transfer-engine", "tcp",
    ]  # fmt: skip
    node = launch(
        argv,
        name=instance_id,
        log=tmp / f"{instance_id}-{port}.log",
        http_port=http_port,
        cls=Node,
        instance_id=instance_id,
        port=port,
        p2p_port=p2p_port,
    )
    assert isinstance(node, Node)
    return node


class V1Engine:
    """An engine of the first release: the frozen engine protocol on a DEALER."""

    def __init__(self, url: str) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(url)
        self._id = 0

    def call(self, body: v1_engine.RequestBody) -> v1_engine.ResponseBody:
        self._id += 1
        self._sock.send_multipart([b"", v1_engine.encode(v1_engine.Request(1, self._id, body))])
        assert self._sock.poll(30_000), "no answer"
        resp = v1_engine.decode_response(self._sock.recv_multipart()[-1])
        assert (resp.v, resp.id) == (1, self._id), resp
        return resp.body

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


def test_a_new_and_a_first_release_node_share_kv_both_ways(tmp_path: Path) -> None:
    coord = start_coordinator(tmp_path)
    nodes: list[Node] = []
    try:
        new = start_node(tmp_path, "node-new", coord)
        nodes.append(new)
        old = start_v1_node(tmp_path, "node-old", coord)
        nodes.append(old)
        wait_peers([new, old])
        c_new, c_old = new.client(), old.client()
        assert (c_new.version, c_old.version) == (2, 1)  # register moved c_old to 1
        on_old, on_new = prompt(N, seed=21), prompt(N, seed=22)
        data_old, data_new = chunk_data(N, SIZE, seed=21), chunk_data(N, SIZE, seed=22)
        assert c_old.store_chunks(on_old, data_old).stored == N
        assert c_new.store_chunks(on_new, data_new).stored == N
        for node, tokens in (("node-old", on_old), ("node-new", on_new)):
            wait_until(
                partial(coord.held, c_new, tokens),
                partial(holds_all, node),
                what=f"{node}'s chunks in the directory",
            )
        for client, tokens, want in ((c_new, on_old, data_old), (c_old, on_new, data_new)):
            res, got = fetch(client, tokens)
            assert (res.hit_chunks, res.peer_chunks, res.p2p_fallback) == (N, N, ""), res
            assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
        # the new node moved to the old one's version once, and nothing was unreadable
        assert "talking to it in 1 (was 2)" in new.text()
        metrics = new.metrics()
        for wire in ("p2p", "engine"):
            series = f'wire_unknown_total{{instance_id="node-new",what="version",wire="{wire}"}}'
            assert f"kvatlas_server_{series} 0.0" in metrics, wire
        v1_engine_reads_from_todays_server(new, on_new, data_new)
    finally:
        for n in nodes:
            n.stop()
        coord.stop()


def v1_engine_reads_from_todays_server(
    node: Node, tokens: list[int], want: list[np.ndarray]
) -> None:
    engine = V1Engine(node.engine_url)
    try:
        reg = engine.call(v1_engine.RegisterEngine("old-eng", MODEL, "float16", (2, 2, 8), CHUNK))
        assert isinstance(reg, v1_engine.EngineRegistered), reg
        ns = v1.Namespace(MODEL, default_kv_rank())
        token_bytes = np.asarray(tokens, "<u4").tobytes()
        found = engine.call(v1_engine.Lookup(ns, token_ids=token_bytes, acquire=True))
        assert isinstance(found, v1_engine.LookupResult), found
        assert found.hit_chunks == N and len(found.chunks) == N
        region = L1Region.attach(reg.region_name, reg.region_size, readonly=True)
        try:
            for loc, data in zip(found.chunks, want, strict=True):
                assert bytes(region.array[loc.offset : loc.offset + loc.size]) == data.tobytes()
        finally:
            region.close()
        released = engine.call(v1_engine.Release([c.lease_id for c in found.chunks]))
        assert released == v1_engine.ReleaseResult(N)
        stats = engine.call(v1_engine.GetStats())
        assert isinstance(stats, v1_engine.StatsResult) and stats.values
    finally:
        engine.close()
