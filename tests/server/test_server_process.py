"""The cache server as a real process: engine API over ZeroMQ with a real CacheClient,
the shared L1 region, L2 promotion, /status /metrics /healthz, startup refusals, and
lossless events to the real coordinator process across its restart."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import zmq

from kvatlas.cli.server import main
from kvatlas.connector.client import (
    CacheClient,
    ContractRefused,
    ModelNotRegistered,
    RequestRefused,
    ServerUnavailable,
    Unauthorized,
)
from kvatlas.core.checksum import checksum
from kvatlas.core.keys import Namespace
from kvatlas.launch.procs import free_port
from kvatlas.wire.engine_proto import (
    CommitItem,
    ErrorReply,
    Lookup,
    decode_response,
)
from support import services
from support.launch import Proc
from support.services import ServerProc, start_coordinator_process, start_server_process
from support.wait import wait_until

CHUNK = 16
MODEL = "tiny"


def start_server(tmp: Path, instance_id: str, *extra: str) -> ServerProc:
    return start_server_process(
        tmp, instance_id,
        "--l1-size-gb", "0.01", "--chunk-size", str(CHUNK), "--engine-workers", "2", *extra,
    )  # fmt: skip


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    s = start_server(tmp_path, "node-a", "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.1")
    yield s
    assert s.stop() == 0, s.text()


def client_for(s: ServerProc) -> CacheClient:
    c = CacheClient(s.engine_url, timeout_s=5.0, engine_id="test-engine")
    c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
    return c


def chunks(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]


# ----------------------------------------------------------------------------- engine API


def test_store_and_retrieve_through_the_shared_region(server: ServerProc) -> None:
    tokens = list(range(CHUNK * 5 + 3))
    data = chunks(5, 20_000)
    with client_for(server) as c:
        assert c.lookup(tokens).hit_tokens == 0
        assert c.store_chunks(tokens, data[:3]).stored == 3
        res = c.store_chunks(tokens, data)
        assert (res.stored, res.existing, res.refused) == (2, 3, 0)
        look = c.lookup(tokens)
        assert (look.hit_tokens, look.hit_chunks, look.total_chunks) == (5 * CHUNK, 5, 5)
        out = c.retrieve_prefix(tokens)
        assert len(out) == 5 and all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        # a different suffix only hits the shared prefix
        other = tokens[: 2 * CHUNK] + [9] * (3 * CHUNK)
        assert c.lookup(other).hit_tokens == 2 * CHUNK
        # by keys
        assert c.lookup(hashes=c.hashes(tokens)[:4]).hit_chunks == 4
        assert c.stats()["read_leases"] == 0
    st = server.status()
    assert st["instance_id"] == "node-a" and st["registration_state"] == "unregistered"
    assert st["l1"]["chunks"] == 5
    assert st["models"] == [MODEL]


def test_read_leases_context_manager_and_writes_in_progress(server: ServerProc) -> None:
    tokens = list(range(CHUNK * 2))
    with client_for(server) as c:
        h = c.hashes(tokens)
        grants = c.reserve(h, [100, 100])
        assert [g.status for g in grants] == ["reserved", "reserved"]
        assert c.lookup(hashes=h).hit_chunks == 0  # not readable while written
        assert c.reserve(h[:1], [100])[0].status == "busy"
        assert c.abort(h[1:]) == 1
        c.view(grants[0].offset, 100)[:] = 7

        item = CommitItem(h[0], grants[0].lease_id, checksum(c.view(grants[0].offset, 100).data))
        assert c.commit([item]) == [True]
        with c.read_leases(h) as locs:
            assert locs[1] is None and locs[0] is not None
            assert c.stats()["read_leases"] == 1
            assert int(c.view(locs[0].offset, locs[0].size)[0]) == 7
        assert c.stats()["read_leases"] == 0


def test_l2_holds_what_l1_evicts_and_lookup_promotes_it(server: ServerProc) -> None:
    size = 1 << 20  # 10 MiB of L1 holds fewer than 10 chunks of 1 MiB
    tokens = list(range(CHUNK * 16))
    data = chunks(16, size, seed=3)
    with client_for(server) as c:
        for h, d in zip(c.hashes(tokens), data, strict=True):  # earlier ones go to L2
            (g,) = c.reserve([h], [size])
            assert g.status == "reserved"
            c.view(g.offset, g.size)[:] = d
            assert c.commit([CommitItem(h, g.lease_id, checksum(d.data))]) == [True]
        st = server.status()
        assert st["l1"]["evictions"] > 0 and st["l2"]["demotions"] > 0
        out = c.retrieve_prefix(tokens[: 4 * CHUNK])
        assert len(out) == 4 and all(np.array_equal(a, b) for a, b in zip(out, data, strict=False))
        assert server.status()["l2"]["promotions"] >= 4


def test_engine_errors_are_clear(server: ServerProc) -> None:
    with CacheClient(server.engine_url, timeout_s=5.0) as c:
        with pytest.raises(ContractRefused, match="chunk_size"):
            c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK * 2)
        c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        with pytest.raises(ContractRefused, match="kv_dtype"):
            c.register(MODEL, "bfloat16", (2, 2, 8), chunk_size=CHUNK)
        c.ns = Namespace("other-model", 1)
        with pytest.raises(ModelNotRegistered):
            c.lookup(list(range(CHUNK)))
        with pytest.raises(RequestRefused, match="exactly one"):
            c.call(Lookup(Namespace(MODEL, 1)))
    # another protocol version is refused by name

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.engine_url)
    sock.send_multipart([b"", msgspec.msgpack.encode({"v": 99, "id": 7, "body": {}})])
    assert sock.poll(5000)
    resp = decode_response(sock.recv_multipart()[-1])
    assert resp.id == 7 and isinstance(resp.body, ErrorReply) and resp.body.code == "version"
    sock.close(0)
    ctx.term()


def test_client_times_out_without_a_server() -> None:
    with CacheClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3) as c:
        t0 = time.monotonic()
        # its own 0.3 s timeout is what ended the call (the error names it); 5 s only
        # guards against a hang on a loaded machine
        with pytest.raises(ServerUnavailable, match=r"did not answer \w+ within 0\.3s"):
            c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        assert time.monotonic() - t0 < 5


def test_concurrent_engines(server: ServerProc) -> None:
    errors: list[BaseException] = []

    def engine(seed: int) -> None:
        try:
            with client_for(server) as c:
                tokens = [seed * 100_000 + i for i in range(CHUNK * 4)]
                data = chunks(4, 4096, seed=seed)
                for _ in range(20):
                    c.store_chunks(tokens, data)
                    out = c.retrieve_prefix(tokens)
                    assert len(out) == len(data)
                    assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_an_engine_cannot_end_another_engines_read_leases(server: ServerProc) -> None:
    """Lease ids are random 63-bit numbers, not 1, 2, 3...: a Release of guessed ids must
    not end the leases of every other engine."""
    tokens = list(range(CHUNK * 4))
    with client_for(server) as a, client_for(server) as b:
        a.store_chunks(tokens, chunks(4, 4096))
        mine = [loc for loc in a.acquire(a.hashes(tokens), lease_s=60) if loc is not None]
        assert len(mine) == 4 and a.stats()["read_leases"] == 4
        theirs = [loc for loc in b.acquire(b.hashes(tokens)[:1], lease_s=60) if loc is not None]
        guesses = list(range(1, 2000)) + [
            loc.lease_id + d for loc in theirs for d in range(-64, 65) if d and loc.lease_id + d > 0
        ]
        assert b.release(guesses) == 0
        assert a.stats()["read_leases"] == 5
        assert a.release([loc.lease_id for loc in mine]) == 4
        assert b.release([loc.lease_id for loc in theirs]) == 1


# --------------------------------------------------------------------------- operations


def test_http_endpoints(server: ServerProc) -> None:
    base = f"http://127.0.0.1:{server.http_port}"
    assert httpx.get(base + "/healthz").json() == {"ok": True}
    st = server.status()
    for field in ("incarnation", "registration_state", "l1", "l2", "leases", "events"):
        assert field in st
    metrics = httpx.get(base + "/metrics").text
    assert 'kvatlas_server_l1_capacity_bytes{instance_id="node-a"}' in metrics


def test_two_servers_and_a_port_in_use(tmp_path: Path, server: ServerProc) -> None:
    second = start_server(tmp_path, "node-b")
    try:
        a, b = server.status(), second.status()
        assert a["l1"]["region_name"] != b["l1"]["region_name"]
    finally:
        assert second.stop() == 0
    clash = subprocess.run(
        [
            sys.executable, "-m", "kvatlas.cli.server", "--port", str(server.port),
            "--http-port", str(free_port()), "--instance-id", "node-c", "--l1-size-gb", "0.01",
            "--state-dir", str(tmp_path / "state"),
        ],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert clash.returncode == 1
    assert f"port 127.0.0.1:{server.port} is already in use" in clash.stderr
    assert "--port" in clash.stderr


def test_incarnation_grows_across_restarts(tmp_path: Path) -> None:
    seen = []
    for _ in range(2):
        s = start_server(tmp_path, "node-r")
        seen.append(int(s.status()["incarnation"]))
        assert s.stop() == 0
    assert seen[1] > seen[0]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--l2-size-gb", "1"], "--l2-size-gb needs --l2-path"),
        (["--event-transport", "kafka", "--coordinator-url", "http://x"], "--kafka-bootstrap"),
        (["--l1-align-bytes", "1000"], "--l1-align-bytes must be a power of two >= 4096"),
        (["--l1-align-bytes", "2048"], "--l1-align-bytes"),
        (["--eviction-policy", "FIFO"], "--eviction-policy"),
        (["--coordinator-url", "localhost:9300"], "--coordinator-url"),
        (
            [
                "--http-port",
                "7601",
                "--coordinator-url",
                "http://x",
                "--p2p-advertise-url",
                "127.0.0.1:7600",
                "--p2p-data-port",
                "7601",
            ],
            "--http-port 7601 is also --p2p-data-port, the tcp transport's data port",
        ),
        (
            [
                "--coordinator-url",
                "http://x",
                "--p2p-advertise-url",
                "127.0.0.1:7600",
                "--p2p-data-port",
                "7600",
            ],
            "--p2p-data-port 7600 is also the P2P control port",
        ),
        (
            [
                "--coordinator-url",
                "http://x",
                "--p2p-advertise-url",
                "127.0.0.1:7600",
                "--p2p-transfer-engine",
                "shm",
                "--p2p-data-port",
                "7601",
            ],
            "--p2p-data-port is the tcp transport's",
        ),
        (["--p2p-data-port", "7601"], "--p2p-data-port needs --p2p-advertise-url"),
        (
            [
                "--port",
                "7600",
                "--coordinator-url",
                "http://x",
                "--p2p-advertise-url",
                "127.0.0.1:7600",
                "--p2p-transfer-engine",
                "shm",
            ],
            "--port 7600 is also the P2P control port",
        ),
    ],
)
def test_startup_refuses_inconsistent_flags(
    tmp_path: Path, flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:

    rc = main(["--instance-id", "x", "--state-dir", str(tmp_path), *flags])
    assert rc == 2
    assert named in capsys.readouterr().err


def test_refusal_message_names_the_flags(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvatlas.cli.server", "--l2-size-gb", "1", "--l1-align-bytes", "3"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "--l2-size-gb needs --l2-path" in r.stderr


# ------------------------------------------------------------------ with the coordinator


def start_coordinator(tmp: Path, port: int = 0, snapshot: bool = True) -> Proc:
    flags = ["--chunk-size", str(CHUNK), "--snapshot-interval", "60"]
    if snapshot:
        flags += ["--snapshot-path", str(tmp / "coord.snapshot")]
    return start_coordinator_process(
        *flags, port=port, log=tmp / f"coord-{time.monotonic_ns()}.log"
    )


def held_prefix(c: Proc, tokens: list[int], iid: str) -> int:
    return services.held_prefix(c, tokens, iid, MODEL)


def gaps(c: Proc, iid: str) -> float:
    text = httpx.get(c.url + "/metrics", timeout=5).text
    m = re.search(rf'kvatlas_coordinator_instance_seq_gaps{{instance_id="{iid}"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def wait_registration(s: ServerProc, state: str) -> None:
    wait_until(
        lambda: s.status()["registration_state"], lambda st: st == state, what=f"{s.name} {state}"
    )


def wait_events(s: ServerProc, field: str, done: Callable[[int], bool], what: str) -> None:
    wait_until(lambda: s.status()["events"][field], done, what=what)


@pytest.mark.slow
def test_coordinator_outage_loses_no_event(tmp_path: Path) -> None:
    coord = start_coordinator(tmp_path)
    s = start_server(
        tmp_path, "node-e", "--coordinator-url", coord.url,
        "--coordinator-heartbeat-interval", "0.3", "--event-flush-interval", "0.1",
        "--coordinator-timeout", "1",
    )  # fmt: skip
    try:
        wait_registration(s, "registered")
        before = list(range(CHUNK * 4))
        during = [7] * CHUNK + list(range(1000, 1000 + CHUNK * 5))
        with client_for(s) as c:
            c.store_chunks(before, chunks(4, 1000))
            wait_until(
                lambda: held_prefix(coord, before, "node-e"), lambda n: n == 4, what="4 chunks"
            )
            assert coord.stop() == 0  # writes its snapshot
            wait_registration(s, "disconnected")
            assert c.store_chunks(during, chunks(6, 1000)).stored == 6  # engines keep working
            wait_events(s, "failed_sends", lambda n: n > 0, "a failed send")
        coord = start_coordinator(tmp_path, coord.http_port)
        wait_events(s, "buffered_batches", lambda n: n == 0, "the buffer to drain")
        assert held_prefix(coord, before, "node-e") == 4
        assert held_prefix(coord, during, "node-e") == 6
        assert gaps(coord, "node-e") == 0
        ev = s.status()["events"]
        assert ev["dropped_batches"] == 0 and ev["retries"] > 0
    finally:
        assert s.stop() == 0, s.text()
        coord.stop()


@pytest.mark.slow
def test_coordinator_that_lost_its_state_is_resynced(tmp_path: Path) -> None:
    coord = start_coordinator(tmp_path, snapshot=False)
    s = start_server(
        tmp_path, "node-f", "--coordinator-url", coord.url,
        "--coordinator-heartbeat-interval", "0.3", "--event-flush-interval", "0.1",
        "--coordinator-timeout", "1",
    )  # fmt: skip
    try:
        tokens = list(range(CHUNK * 3))
        with client_for(s) as c:
            c.store_chunks(tokens, chunks(3, 1000))
        wait_until(lambda: held_prefix(coord, tokens, "node-f"), lambda n: n == 3, what="3 chunks")
        assert coord.stop() == 0
        coord = start_coordinator(tmp_path, coord.http_port, snapshot=False)
        wait_until(
            lambda: held_prefix(coord, tokens, "node-f"), lambda n: n == 3, what="3 chunks resynced"
        )
        st = s.status()
        assert st["coordinator"]["resyncs"] >= 1
        assert st["registration_state"] == "registered"
    finally:
        assert s.stop() == 0, s.text()
        coord.stop()


def test_auth_token_guards_the_engine_api_and_status(tmp_path: Path) -> None:
    s = start_server(tmp_path, "node-secret", "--auth-token", "s3cret")
    try:
        base = f"http://127.0.0.1:{s.http_port}"
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        assert httpx.get(f"{base}/status", timeout=5).status_code == 401
        assert httpx.get(f"{base}/metrics", timeout=5).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert httpx.get(f"{base}/status", headers=bad, timeout=5).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{base}/status", headers=good, timeout=5).status_code == 200

        anonymous = CacheClient(s.engine_url, timeout_s=5.0)
        with pytest.raises(Unauthorized):
            anonymous.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        anonymous.close()
        trusted = CacheClient(s.engine_url, timeout_s=5.0, auth_token="s3cret")
        trusted.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        assert trusted.lookup(list(range(CHUNK))).hit_tokens == 0
        trusted.close()
    finally:
        assert s.stop() == 0, s.text()


def _unread_requests(port: int) -> int:
    """Connections to ``port`` on loopback holding bytes its listener has not read (a
    frozen process's requests), from the kernel's table (/proc/net/tcp)."""
    n = 0
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, local, _, state, queues = row.split()[:5]
        established = state == "01"
        if established and int(local.split(":")[1], 16) == port and int(queues[9:], 16):
            n += 1
    return n


def test_a_frozen_coordinator_does_not_hold_a_stopping_server(tmp_path: Path) -> None:
    """SIGTERM with the coordinator frozen: the server leaves, not waiting out the
    coordinator timeout (here 120 s) of the calls still waiting on it."""
    coord = start_coordinator(tmp_path, snapshot=False)
    try:
        srv = start_server_process(
            tmp_path, "node-a", "--chunk-size", "16", "--l1-size-gb", "0.01",
            "--no-l1-prefault", "--coordinator-url", coord.url,
            "--coordinator-heartbeat-interval", "0.1", "--coordinator-timeout", "120",
            "--event-flush-interval", "0.1", "--p2p-advertise-url", f"127.0.0.1:{free_port()}",
        )  # fmt: skip
        wait_until(
            lambda: srv.status()["registration_state"],
            lambda state: state == "registered",
            what="node-a registered",
        )
        coord.popen.send_signal(signal.SIGSTOP)
        try:
            wait_until(
                lambda: _unread_requests(int(coord.url.rsplit(":", 1)[1])),
                what="a request of node-a's waiting on the frozen coordinator",
            )
            t0 = time.monotonic()
            code = srv.stop(grace_s=100)
            took = time.monotonic() - t0
        finally:
            coord.popen.send_signal(signal.SIGCONT)
        # a call that waited out its timeout would take 120 s at least
        assert code == 0 and took < 60, (code, took)
    finally:
        coord.stop()
