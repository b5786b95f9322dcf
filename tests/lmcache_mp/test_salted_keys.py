"""LMCache 0.5.6's own MP client (its unmodified vLLM adapters, ``mp_driver.py`` in
.venv-lmcache) storing keys with a ``cache_salt`` (``IPCCacheServerKey.cache_salt``,
vLLM's per-tenant isolation) in a real ``kvatlas server``: the same salt hits, another
salt or none misses, an unsalted store is not found by a salted lookup, and across P2P a
tenant on node B never gets node A's chunks of another tenant (issue #37)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from lmcache_mp.driver import Driver
from p2p.cluster import cluster, wait_peers
from support.services import start_server_process
from support.wait import wait_until

pytestmark = pytest.mark.lmcache

CHUNK = 256
TENANT_A, TENANT_B = "tenant-a", "tenant-b"


def prompt(seed: int, chunk: int = CHUNK) -> list[int]:
    """Two full chunks and a partial one (never stored)."""
    return [seed * 100_000 + i for i in range(2 * chunk + chunk // 2)]


@pytest.mark.parametrize("mode", ["engine_driven", "lmcache_driven"])
def test_a_salt_is_part_of_the_key(tmp_path: Path, lmcache_venv: Path, mode: str) -> None:
    srv = start_server_process(
        tmp_path, "mp-salt", "--l1-size-gb", "0.05", "--chunk-size", str(CHUNK)
    )
    drv = Driver(lmcache_venv, srv.engine_url, mode, tmp_path / "driver.log")
    try:
        tokens = prompt(1)
        stored = drv.call("store", tokens, "s-a", seed=11, salt=TENANT_A)
        assert stored["ok"] and stored["hit"] == 0 and len(stored["digests"]) == 2, stored
        same = drv.call("fetch", tokens, "f-a", salt=TENANT_A)
        assert same["ok"] and same["hit"] == 2 and same["digests"] == stored["digests"], same
        assert drv.call("fetch", tokens, "f-b", salt=TENANT_B)["hit"] == 0
        assert drv.call("fetch", tokens, "f-none")["hit"] == 0
        # Tenant B storing the same tokens gets entries of its own: nothing of A's is
        # found at its store's lookup, and A's bytes stay A's.
        theirs = drv.call("store", tokens, "s-b", seed=22, salt=TENANT_B)
        assert theirs["ok"] and theirs["hit"] == 0 and theirs["digests"] != stored["digests"]
        assert drv.call("fetch", tokens, "f-a2", salt=TENANT_A)["digests"] == stored["digests"]
        assert drv.call("fetch", tokens, "f-b2", salt=TENANT_B)["digests"] == theirs["digests"]
        # The reverse: an unsalted store is not found by a salted lookup.
        plain = prompt(2)
        unsalted = drv.call("store", plain, "s-plain", seed=33)
        assert unsalted["ok"] and unsalted["hit"] == 0, unsalted
        assert drv.call("fetch", plain, "f-plain-a", salt=TENANT_A)["hit"] == 0
        got = drv.call("fetch", plain, "f-plain")
        assert got["hit"] == 2 and got["digests"] == unsalted["digests"], got
        assert srv.status()["leases"]["read"] == 0  # misses hold no lock either
    finally:
        drv.close()
        srv.stop()


def test_p2p_serves_a_tenant_only_its_own_chunks(tmp_path: Path, lmcache_venv: Path) -> None:
    """A's worker stores tenant-a's chunks; B's worker asks for the same tokens as
    tenant-b and unsalted (misses, nothing read from A), then as tenant-a (a hit over
    P2P, the bytes A stored), then as tenant-b again (still a miss with the chunks in
    B's own L1 now)."""
    with cluster(tmp_path, "node-a", "node-b") as (coord, (na, nb)):
        wait_peers([na, nb])
        a = Driver(lmcache_venv, na.engine_url, "engine_driven", tmp_path / "a.log")
        b = Driver(lmcache_venv, nb.engine_url, "lmcache_driven", tmp_path / "b.log")
        try:
            tokens = prompt(3, chunk=16)  # the cluster's --chunk-size
            stored = a.call("store", tokens, "s", seed=9, salt=TENANT_A)
            assert stored["ok"] and stored["hit"] == 0, stored
            # The directory knows A's chunks: a miss below is the salt's, not timing's.
            wait_until(
                lambda: httpx.get(f"{coord.url}/directory/stats", timeout=5).json()["keys"],
                lambda keys: keys >= 2,
                what="A's two chunks in the directory",
                timeout=20,
            )
            assert b.call("fetch", tokens, "f-b", salt=TENANT_B)["hit"] == 0
            assert b.call("fetch", tokens, "f-none")["hit"] == 0
            assert nb.status()["p2p"]["chunks_fetched"] == 0
            got = wait_until(
                lambda: b.call("fetch", tokens, f"f-a{time.monotonic_ns()}", salt=TENANT_A),
                lambda got: got["hit"] >= 2,
                what="B fetches A's two chunks under A's salt",
                timeout=20,
                every=0.3,
            )
            assert got["ok"] and got["hit"] == 2 and got["digests"] == stored["digests"], got
            assert nb.status()["p2p"]["chunks_fetched"] >= 2
            assert b.call("fetch", tokens, "f-b2", salt=TENANT_B)["hit"] == 0
        finally:
            a.close()
            b.close()
