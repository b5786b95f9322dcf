"""LMCache 0.5.6's unmodified vLLM adapters (``mp_driver.py`` in .venv-lmcache) against
``kvatlas server``: both CPU transfer modes, P2P across two servers, a restart under a
connected client, and requests the server must refuse at once (raw ZeroMQ, here)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvatlas.connector.client import CacheClient
from kvatlas.launch.procs import HOST, free_ports
from lmcache_mp.driver import QUIET, Driver
from p2p.cluster import cluster, wait_peers
from support.launch import launch
from support.services import ServerProc, start_server_process
from support.wait import wait_until

pytestmark = pytest.mark.lmcache

CHUNK = 256
BLOCK = 16
"""The driver's (vLLM's) tokens per KV block."""


def prompt(seed: int, chunks: int = 2, chunk: int = CHUNK) -> list[int]:
    """``chunks`` full chunks and a partial one (never stored)."""
    return [seed * 100_000 + i for i in range(chunks * chunk + chunk // 2)]


def settled_fetch(
    drv: Driver, tokens: list[int], rid: str, hits: int, retries: int
) -> dict[str, Any]:
    """A fetch, repeated (``retries`` times at most) while it finds fewer than ``hits``.

    ``lmcache server`` reports a store finished before it commits the chunks (the commit
    is a callback queued behind the copy), so on a busy machine its next lookup can miss
    the last chunk stored. kvatlas commits before it answers, so it never needs a retry;
    the comparison is of the settled answers."""
    got = drv.call("fetch", tokens, rid)
    for attempt in range(retries):
        if got["hit"] >= hits:
            break
        time.sleep(0.05 * (attempt + 1))
        got = drv.call("fetch", tokens, f"{rid}-again{attempt}")
    return got


def server(tmp_path: Path, name: str = "mp-a") -> ServerProc:
    return start_server_process(tmp_path, name, "--l1-size-gb", "0.05", "--chunk-size", "256")


@pytest.mark.parametrize("mode", ["engine_driven", "lmcache_driven"])
def test_unmodified_adapters_store_lookup_retrieve(
    tmp_path: Path, lmcache_venv: Path, mode: str
) -> None:
    srv = server(tmp_path)
    drv = Driver(lmcache_venv, srv.engine_url, mode, tmp_path / "driver.log")
    try:
        tokens = prompt(1)
        stored = drv.call("store", tokens, "s1", seed=11)
        assert stored["ok"] and stored["hit"] == 0 and len(stored["digests"]) == 2, stored
        got = drv.call("fetch", tokens, "f1")
        assert got["ok"] and got["hit"] == 2, got
        assert got["digests"] == stored["digests"]  # the bytes that landed are the stored ones
        # a prompt sharing one chunk hits one
        other = tokens[:CHUNK] + [7] * (CHUNK + 40)
        assert drv.call("fetch", other, "f2")["hit"] == 1
        metrics = srv.metrics()
        op = "prepare_store" if mode == "engine_driven" else "store"
        assert f'kvatlas_server_lmcache_requests_total{{instance_id="mp-a",operation="{op}"}}' in (
            metrics
        )
        assert srv.status()["leases"]["read"] == 0  # retrieves and end_session released them
        assert drv.call("reset", [], "")["ok"]  # clear: the chunks are gone
        assert drv.call("fetch", tokens, "f3")["hit"] == 0
    finally:
        drv.close()
        srv.stop()


def test_modes_share_chunks(tmp_path: Path, lmcache_venv: Path) -> None:
    """A chunk stored engine-driven is retrieved lmcache-driven, bytes equal."""
    srv = server(tmp_path)
    a = Driver(lmcache_venv, srv.engine_url, "engine_driven", tmp_path / "a.log")
    b = Driver(lmcache_venv, srv.engine_url, "lmcache_driven", tmp_path / "b.log")
    try:
        tokens = prompt(2)
        stored = a.call("store", tokens, "s", seed=5)
        got = b.call("fetch", tokens, "f")
        assert got["hit"] == 2 and got["digests"] == stored["digests"], (stored, got)
    finally:
        a.close()
        b.close()
        srv.stop()


@pytest.mark.parametrize(
    ("a_mode", "b_mode", "fault"),
    [
        ("engine_driven", "lmcache_driven", ""),
        ("lmcache_driven", "engine_driven", "kill"),
        ("lmcache_driven", "engine_driven", "freeze"),
    ],
    ids=["stored-engine-driven", "storing-worker-killed", "storing-worker-frozen"],
)
def test_p2p_across_two_kvatlas_servers(
    tmp_path: Path, lmcache_venv: Path, a_mode: str, b_mode: str, fault: str
) -> None:
    """B's worker gets what A's worker stored, over P2P, bytes equal. With a ``fault``,
    A's worker (lmcache-driven: its server copied from the worker's KV tensors) is
    killed or frozen the moment its store answers, while A may still be hashing those
    chunks: A keeps serving them, to B and to a fresh worker of its own, ends with no
    checksum pending and no write lease held, and a frozen worker, thawed, is served
    too."""
    with cluster(tmp_path, "node-a", "node-b") as (_, (na, nb)):
        wait_peers([na, nb])
        a = Driver(lmcache_venv, na.engine_url, a_mode, tmp_path / "a.log")
        b = Driver(lmcache_venv, nb.engine_url, b_mode, tmp_path / "b.log")
        try:
            tokens = prompt(3, chunk=16)  # the cluster's --chunk-size
            stored = a.call("store", tokens, "s", seed=9)
            assert stored["ok"] and stored["hit"] == 0, stored
            if fault == "kill":
                a.proc.stop(signal.SIGKILL)  # no shutdown, no unregister
                for seg in Path("/dev/shm").glob(f"lmcache_kv_{a.proc.pid}_*"):
                    seg.unlink()  # its KV tensors' segments (it could not unlink them)
            elif fault == "freeze":
                a.proc.freeze()
            got = wait_until(
                lambda: b.call("fetch", tokens, f"f{time.monotonic_ns()}"),
                lambda got: got["hit"] >= 2,
                what="B fetches both chunks from A",  # A's STOREs are in flight
                timeout=20,
                every=0.3,
            )
            assert got["ok"] and got["hit"] == 2, got
            assert got["digests"] == stored["digests"]
            assert nb.status()["p2p"]["chunks_fetched"] >= 2
            unhashed = 'kvatlas_server_lmcache_unhashed_chunks{instance_id="node-a"} 0.0'
            assert unhashed in na.metrics()
            assert na.status()["leases"]["write"] == 0
            if fault:  # requests after the fault: A serves a fresh worker of its own
                c = Driver(lmcache_venv, na.engine_url, "engine_driven", tmp_path / "c.log")
                try:
                    mine = c.call("fetch", tokens, "c0")
                    assert mine["hit"] == 2 and mine["digests"] == stored["digests"], mine
                finally:
                    c.close()
            if fault == "freeze":  # and the frozen worker, thawed
                a.proc.thaw()
                again = a.call("fetch", tokens, "a-thawed")
                assert again["hit"] == 2 and again["digests"] == stored["digests"], again
        finally:
            a.close()
            b.close()


def test_restart_under_a_connected_client(tmp_path: Path, lmcache_venv: Path) -> None:
    srv = server(tmp_path)
    port, http_port = srv.port, int(srv.url.rsplit(":", 1)[1])
    drv = Driver(lmcache_venv, srv.engine_url, "engine_driven", tmp_path / "driver.log")
    try:
        tokens = prompt(4)
        stored = drv.call("store", tokens, "s", seed=1)
        assert stored["ok"], stored
        srv.stop(signal.SIGKILL)  # killed: no shutdown code runs
        srv = start_server_process(
            tmp_path, "mp-a", "--l1-size-gb", "0.05", port=port, http_port=http_port
        )
        # A warm restart: the server serves the chunks it held. Until LMCache's heartbeat
        # re-registers the worker's KV (the server's first ping answer is False), a fetch
        # fails or misses (the client recomputes), never anything wrong; then it hits the
        # bytes stored before the kill, without storing them again.

        def fetch() -> dict[str, Any]:
            got: dict[str, Any] = drv.call("fetch", tokens, f"f{time.monotonic_ns()}")
            if got.get("ok") and got.get("hit"):
                assert got["digests"] == stored["digests"][: got["hit"]], got
            return got

        wait_until(
            fetch,
            lambda got: got.get("hit") == 2,
            what="the restarted server serves both chunks it held",
            timeout=90,  # LMCache's heartbeat: every 10 s
            every=1,
        )
        assert "L1 warm start" in srv.text()
    finally:
        drv.close()
        srv.stop()


def _ask(url: str, frames: list[bytes]) -> list[bytes]:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(url)
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply: the client would hang until its timeout"
        return sock.recv_multipart()
    finally:
        ctx.destroy(0)


def test_unknown_malformed_and_other_versions_get_an_error_reply(tmp_path: Path) -> None:
    srv = start_server_process(tmp_path, "mp-a", "--l1-size-gb", "0.02")
    try:
        enc = msgspec.msgpack.encode
        # get_chunk_size by its 0.5.6 id answers
        assert _ask(srv.engine_url, [enc(1), enc(21)]) == [enc(1), enc(21), enc(256)]
        cases = {
            "unsupported": [enc(2), enc(25), enc(1)],  # cb_register_rope: not served
            "version": [enc(3), enc(11), enc("r")],  # retired in 0.5.6
            "version ": [enc(4), enc(99)],  # no such id in 0.5.6
            "version  ": [enc(5), enc(22)],  # ping without its argument
            "malformed": [enc(6), b"\xc1"],  # not msgpack
        }
        for want, frames in cases.items():
            reply = _ask(srv.engine_url, frames)
            assert reply[0] == frames[0] and len(reply) == 2, reply
            text = msgspec.msgpack.decode(reply[1])
            assert text.startswith("error: "), text
            if want.strip() == "version":
                assert "0.5.6" in text
        metrics = srv.metrics()
        for reason in ("unsupported", "version", "malformed"):
            assert f'reason="{reason}"' in metrics, metrics
        assert "LMCache MP request refused (version" in srv.text()
        # the kvatlas engine API still answers on the same port
        c = CacheClient(f"tcp://{HOST}:{srv.port}", timeout_s=10)
        try:
            assert c.register("m", "float16", (2, 2, 8), chunk_size=256) is not None
        finally:
            c.close()
    finally:
        srv.stop()


def test_auth_token_refuses_lmcache_unless_admitted(tmp_path: Path) -> None:
    srv = start_server_process(tmp_path, "mp-t", "--l1-size-gb", "0.02", "--auth-token", "s3cret")
    try:
        enc = msgspec.msgpack.encode
        reply = _ask(srv.engine_url, [enc(1), enc(21)])
        text = msgspec.msgpack.decode(reply[1])
        assert text.startswith("error: ") and "--lmcache-mp on" in text, text
        assert (
            'reason="disabled"'
            in httpx.get(
                f"{srv.url}/metrics", headers={"Authorization": "Bearer s3cret"}, timeout=5
            ).text
        )
    finally:
        srv.stop()
    srv = start_server_process(
        tmp_path, "mp-u", "--l1-size-gb", "0.02", "--auth-token", "s3cret", "--lmcache-mp", "on"
    )
    try:
        assert _ask(srv.engine_url, [msgspec.msgpack.encode(1), msgspec.msgpack.encode(21)])[
            2
        ] == msgspec.msgpack.encode(256)
    finally:
        srv.stop()


def test_same_answers_as_lmcache_server(tmp_path: Path, lmcache_venv: Path) -> None:
    """The same adapter calls against `lmcache server` 0.5.6 and `kvatlas server`:
    the same hit counts and the same bytes back, in both modes."""
    port, http_port = free_ports(2)
    env = {**os.environ, **QUIET}
    env.pop("PYTHONPATH", None)
    ref = launch(
        [
            str(lmcache_venv / "bin" / "lmcache"), "server", "--host", HOST, "--port", str(port),
            "--http-host", HOST, "--http-port", str(http_port), "--chunk-size", "256",
            "--l1-size-gb", "0.0625", "--no-l1-use-lazy", "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto",
        ],
        name="lmcache-server",
        log=tmp_path / "lmcache-server.log",
        env=env,
        http_port=http_port,
        wait=False,
    )  # fmt: skip
    srv = server(tmp_path)
    try:
        ref.wait_http("/healthcheck", timeout=90)
        answers: dict[str, list[tuple[bool, int, list[str]]]] = {}
        sums: dict[tuple[str, ...], tuple[int, Any]] = {}
        http = {"lmcache": f"http://{HOST}:{http_port}", "kvatlas": srv.url}
        for name, url in (("lmcache", f"tcp://{HOST}:{port}"), ("kvatlas", srv.engine_url)):
            for mode in ("engine_driven", "lmcache_driven"):
                drv = Driver(lmcache_venv, url, mode, tmp_path / f"{name}-{mode}.log")
                retries = 5 if name == "lmcache" else 0  # kvatlas must be right at once
                try:
                    seed = 20 if mode == "engine_driven" else 30
                    a, b = prompt(seed, 3), prompt(seed, 3)[: 2 * CHUNK] + [1] * 300
                    seq = [
                        drv.call("fetch", a, "f0"),
                        drv.call("store", b, "s0", seed=seed),  # 3 chunks
                        drv.call("store", a, "s1", seed=seed),  # 1 more (2 shared with b)
                        settled_fetch(drv, a, "f1", hits=3, retries=retries),
                        settled_fetch(drv, b, "f2", hits=3, retries=retries),
                    ]
                    # LMCache's /cache/checksums over the stored blocks, as its bench asks
                    # three full chunks and a short one, from the store's first block
                    n_blocks = 3 * CHUNK // BLOCK + 5
                    mine = drv.call("checksums", [], "", first=0, blocks=n_blocks)
                    asked = {
                        "block_ids": list(range(n_blocks)),
                        "chunk_size": CHUNK // BLOCK,
                        "instance_id": mine["instance_id"],
                        "layerwise": False,
                    }
                    r = httpx.post(f"{http[name]}/cache/checksums", json=asked, timeout=30)
                    sums[(name, mode)] = (r.status_code, r.json() if r.is_success else None)
                    if r.is_success:  # the bench's client-side digests of the full chunks
                        assert r.json()["chunk_checksums"][:3] == mine["client"], mode
                    layered = httpx.post(
                        f"{http[name]}/cache/checksums", json={**asked, "layerwise": True}
                    )
                    sums[(name, mode, "layerwise")] = (
                        layered.status_code,
                        layered.json() if layered.is_success else None,
                    )
                finally:
                    drv.close()
                answers.setdefault(name, []).extend(
                    (r["ok"], r["hit"], r["digests"] if r["hit"] else []) for r in seq
                )
        assert answers["kvatlas"] == answers["lmcache"], answers
        for mode in ("engine_driven", "lmcache_driven"):
            for extra in ((), ("layerwise",)):
                ours, theirs = sums[("kvatlas", mode, *extra)], sums[("lmcache", mode, *extra)]
                assert ours == theirs, (mode, extra, ours, theirs)
        assert sums[("kvatlas", "lmcache_driven")][0] == 200
        assert [hit for _, hit, _ in answers["kvatlas"][:5]] == [0, 0, 2, 3, 3]
    finally:
        srv.stop()
        ref.stop(signal.SIGINT)
