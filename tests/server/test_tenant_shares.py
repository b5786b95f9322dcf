"""Per-tenant L1 shares through a real ``kvatlas server`` and its engine API: tenant "a"
(cache_salt "a") stores up to its share, tenant "b" floods four times what L1 holds;
with ``--l1-tenant-min-share`` every chunk of "a" is still a hit, without it the global
LRU evicts them all. ``/status`` (``l1_by_salt``) and ``/metrics`` tell which tenant's
requests evicted whom."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvatlas.connector.client import CacheClient
from support.cache_fleet import CHUNK, CHUNK_BYTES, L1_GB, MODEL, data, prompt
from support.services import ServerProc, start_server_process

L1_CHUNKS = 16
"""1 MiB of 64 KiB chunks (``support.cache_fleet``)."""
SHARE = 0.25
"""4 chunks per tenant (two tenants: the equal split, 8, is larger)."""


def tenant(server: ServerProc, salt: str) -> CacheClient:
    c = CacheClient(server.engine_url, timeout_s=10, engine_id=f"eng-{salt}")
    c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK, cache_salt=salt)
    return c


@pytest.fixture(params=[True, False], ids=["shares", "global-lru"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ServerProc, bool]]:
    on: bool = request.param
    flags = ["--l1-tenant-min-share", str(SHARE)] if on else []
    s = start_server_process(
        tmp_path, "node-t", "--l1-size-gb", L1_GB, "--chunk-size", str(CHUNK), *flags
    )
    yield s, on
    assert s.stop() == 0, s.tail()


def test_a_flooding_tenant_cannot_evict_another_within_its_share(
    server: tuple[ServerProc, bool],
) -> None:
    s, on = server
    a, b = tenant(s, "a"), tenant(s, "b")
    try:
        mine = prompt(4, seed=1)
        assert a.store_chunks(mine, data(4, 1)).stored == 4
        assert a.lookup(mine).hit_chunks == 4
        for seed in range(10, 18):  # 8 prompts of 8 chunks: 4x what L1 holds
            assert b.store_chunks(prompt(8, seed), data(8, seed)).stored == 8
        assert b.lookup(mine).hit_chunks == 0, "another salt's keys are other keys"
        by_salt = s.status()["l1_by_salt"]
        metrics = s.metrics()
        if on:
            assert a.lookup(mine).hit_chunks == 4
            assert by_salt["a"] == {
                "bytes": 4 * CHUNK_BYTES, "chunks": 4, "evicted_by_own": 0, "evicted_by_others": 0,
            }  # fmt: skip
            assert by_salt["b"]["chunks"] == L1_CHUNKS - 4
            assert by_salt["b"]["evicted_by_own"] == 64 - (L1_CHUNKS - 4)
            assert s.status()["l1"]["tenant_share_bytes"] == 4 * CHUNK_BYTES
            assert 'kvatlas_server_l1_cross_salt_evictions_total{instance_id="node-t"} 0.0' in (
                metrics
            )
        else:
            assert a.lookup(mine).hit_chunks == 0
            assert by_salt["a"] == {
                "bytes": 0, "chunks": 0, "evicted_by_own": 0, "evicted_by_others": 4,
            }  # fmt: skip
            assert by_salt["b"]["chunks"] == L1_CHUNKS
            assert s.status()["l1"]["tenant_share_bytes"] == 0
            assert 'kvatlas_server_l1_cross_salt_evictions_total{instance_id="node-t"} 4.0' in (
                metrics
            )
        a_bytes = by_salt["a"]["bytes"]
        assert f'kvatlas_server_l1_salt_bytes{{instance_id="node-t",salt="a"}} {a_bytes}.0' in (
            metrics
        )
        others = by_salt["a"]["evicted_by_others"]
        assert (
            'kvatlas_server_l1_salt_evictions_total{by="other",instance_id="node-t",salt="a"}'
            f" {others}.0"
        ) in metrics
    finally:
        a.close()
        b.close()
