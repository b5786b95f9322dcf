"""The reference guide's single-machine test: node A computes a prompt, node B (empty)
serves the same prompt from A's L1 through P2P, byte for byte; plus startup refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from kvatlas.cli.server import build_parser, config_from_args
from kvatlas.connector.client import CacheClient
from kvatlas.core.errors import ConfigError
from kvatlas.launch.procs import free_port
from kvatlas.runtime.region import L1Region
from kvatlas.server.p2p.node import check_single_region
from kvatlas.transfer.factory import make_transport
from kvatlas.wire.engine_proto import LookupResult
from support.wait import wait_until
from transfer.harness import netns_available

from .cluster import CHUNK, chunk_data, cluster, prompt, wait_peers


def fetch(
    client: CacheClient, tokens: list[int]
) -> tuple[LookupResult, list[npt.NDArray[np.uint8]]]:
    """B's engine: lookup with read leases, copy the hit chunks out, release."""
    res = client.lookup(tokens, acquire=True)
    try:
        out = []
        for loc in res.chunks:
            dst = np.empty(loc.size, np.uint8)
            client.read_into(loc, dst)
            out.append(dst)
        return res, out
    finally:
        client.release([loc.lease_id for loc in res.chunks])


def single_machine(tmp_path: Path, transport: str, n_chunks: int = 6, size: int = 3000) -> None:
    with cluster(tmp_path, "node-a", "node-b", transport=transport) as (coord, (a, b)):
        wait_peers([a, b])
        for node, other in ((a, b), (b, a)):
            st = node.status()
            assert st["p2p_enabled"] is True
            assert st["p2p_state"] == "registered"
            assert st["p2p_peer_count"] == 1 and st["p2p_peers"] == [other.instance_id]
            assert st["active_p2p_lookup_jobs"] == 0
            assert st["p2p"]["transfer_engine"] == transport
        tokens = prompt(n_chunks, seed=1)
        data = chunk_data(n_chunks, size, seed=1)
        ca, cb = a.client(), b.client()
        assert ca.store_chunks(tokens, data).stored == n_chunks
        wait_until(
            lambda: coord.held(ca, tokens), lambda h: h.get("node-a") == n_chunks, what="directory"
        )
        res, got = fetch(cb, tokens)
        assert (res.hit_chunks, res.peer_chunks, res.p2p_fallback) == (n_chunks, n_chunks, "")
        assert res.hit_tokens == n_chunks * CHUNK
        assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=True))
        # a second lookup is a local hit
        res2 = cb.lookup(tokens)
        assert (res2.hit_chunks, res2.peer_chunks) == (n_chunks, 0)
        # B published STOREs: the directory lists both
        wait_until(
            lambda: coord.held(cb, tokens), lambda h: h.get("node-b") == n_chunks, what="B's STOREs"
        )
        assert coord.held(cb, tokens)["node-a"] == n_chunks
        sb, sa = b.status(), a.status()
        assert sb["p2p"]["chunks_fetched"] == n_chunks
        assert sb["p2p"]["bytes_read"] == n_chunks * size
        assert sa["p2p"]["served_chunks"] == n_chunks
        assert sa["leases"]["read"] == 0  # acknowledged unlock released A's leases
        metrics = b.metrics()
        assert 'kvatlas_server_p2p_bytes_read_total{instance_id="node-b"}' in metrics
        assert "kvatlas_server_active_p2p_lookup_jobs" in metrics
        logs_b = b.text()
        assert "Registered with coordinator as node-b" in logs_b
        assert "Added P2P adapter 0 for peer node-a (127.0.0.1:" in logs_b


def test_single_machine_tcp(tmp_path: Path) -> None:
    single_machine(tmp_path, "tcp")


@pytest.mark.slow  # 15 s measured on the 2-core VM; the fast lane keeps the tcp one
def test_single_machine_shm(tmp_path: Path) -> None:
    single_machine(tmp_path, "shm")


@pytest.mark.slow  # 15 s measured on the 2-core VM (load average 5 to 11)
def test_tcp_binds_and_announces_the_data_port_given(tmp_path: Path) -> None:
    port = free_port()
    extra = {"node-a": ["--p2p-data-port", str(port)]}
    with cluster(tmp_path, "node-a", "node-b", extra=extra) as (coord, (a, b)):
        wait_peers([a, b])
        assert a.status()["p2p"]["transfer_url"] == f"tcp://127.0.0.1:{port}"
        assert b.status()["p2p"]["transfer_url"] != f"tcp://127.0.0.1:{port}"
        tokens, data = prompt(2, seed=3), chunk_data(2, 1000, seed=3)
        ca, cb = a.client(), b.client()
        assert ca.store_chunks(tokens, data).stored == 2
        wait_until(lambda: coord.held(ca, tokens), lambda h: h.get("node-a") == 2, what="directory")
        res, got = fetch(cb, tokens)
        assert (res.peer_chunks, res.p2p_fallback) == (2, "")
        assert all(np.array_equal(x, y) for x, y in zip(got, data, strict=True))


def test_p2p_without_coordinator_refuses_to_start(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable, "-m", "kvatlas.cli.server", "--instance-id", "x",
            "--state-dir", str(tmp_path), "--p2p-advertise-url", "127.0.0.1:8555",
        ],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "P2P requires a coordinator for peer discovery" in r.stderr
    assert "--coordinator-url" in r.stderr


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--p2p-advertise-url", "nohost"], "--p2p-advertise-url must be HOST:PORT"),
        (["--p2p-advertise-url", "127.0.0.1:1", "--p2p-transfer-engine", "rdma"], "rdma"),
        (["--p2p-advertise-url", "127.0.0.1:1", "--p2p-load-timeout", "0"], "--p2p-load-timeout"),
        (["--p2p-listen-url", "0.0.0.0:1"], "--p2p-listen-url needs --p2p-advertise-url"),
    ],
)
def test_p2p_flags_are_validated(tmp_path: Path, flags: list[str], named: str) -> None:

    args = build_parser().parse_args(
        [
            "--instance-id",
            "x",
            "--state-dir",
            str(tmp_path),
            "--coordinator-url",
            "http://c:1",
            *flags,
        ]
    )
    with pytest.raises(ConfigError, match=named):
        config_from_args(args, {})


def test_p2p_needs_one_contiguous_region(tmp_path: Path) -> None:
    with L1Region.create(1 << 16, "t") as region:
        check_single_region(region, 1 << 16)
        with pytest.raises(ConfigError, match="single contiguous L1 memory region"):
            check_single_region(region, 1 << 17)


def _transport_missing(transport: str) -> str | None:

    try:
        make_transport(transport)
    except Exception as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_single_machine_mooncake_in_a_private_netns(tmp_path: Path) -> None:
    if reason := _transport_missing("mooncake"):
        pytest.skip(reason)
    if not netns_available():
        pytest.skip("unshare -rn (a private network namespace) is not available here")
    tests_dir = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")]),
    }
    script = 'ip link set lo up && exec "$@"'
    r = subprocess.run(
        ["unshare", "-rn", "sh", "-c", script, "sh", sys.executable, "-m", "p2p.netns_single",
         "mooncake", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert r.returncode == 0 and "NETNS-SINGLE-MACHINE-OK" in r.stdout, r.stdout + r.stderr[-4000:]


@pytest.mark.slow
def test_single_machine_nixl(tmp_path: Path) -> None:
    if reason := _transport_missing("nixl"):
        pytest.skip(reason)
    single_machine(tmp_path, "nixl")
