"""The fleet L2 eviction loop on a real fleet: `kvatlas coordinator` keeps a salt under
its quota by telling real LMCache 0.5.6 servers and kvatlas servers to delete, the
least recently used first, pinned chunks never.

One `lmcache server` (MP mode, CPU, L1 plus LMCache's in-memory ``mock`` L2 adapter,
stored into through LMCache's own client path by its stand-in engine) and one
`kvatlas server` (an L1 of 16 chunks and a disk L2, stored into by a CacheClient past
what L1 holds, so chunks spill to L2) report to one kvatlas coordinator whose loop
sweeps every 0.3 s. Both store under the empty salt (LMCache's client path has no
salt), so the salt's usage is the two servers' L2 together: the test sets its quota
below what they stored, pins one prompt on each, and waits until the usage is back
under the quota, the servers' L2 holding only what the directory says (their DELETE
events came back; the kvatlas server's own listing agrees), and the pinned chunks still
held. (Which unpinned keys go first, least recently used, is `eviction_plan`'s and is
tested on the core: here the order depends on when each server's events arrive.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.connector.client import CacheClient
from support.services import ServerProc, start_server_process
from support.wait import wait_until

from .fleet import CHUNK, MODEL, WAIT_S, Engine, KvatlasCoordinator, LMCacheServer, prompt

pytestmark = [pytest.mark.lmcache]

GIB = 1024**3
KV_CHUNK_BYTES = 64 * 1024
"""A kvatlas server's chunk here: 16 of them fill its 1 MiB L1."""
QUOTA = 2**20
"""1 MiB: under the 2.5 MiB the two servers store in L2, over the 0.5 MiB pinned."""


def l2_bytes(coord: KvatlasCoordinator) -> int:
    body: dict[str, Any] = coord.http.get("/quota/_default").json()
    return round(float(body["usage_gb"]) * GIB)


def l2_placements(coord: KvatlasCoordinator, tokens: list[int]) -> list[set[str]]:
    """Per complete chunk of ``tokens``: the instances holding it in L2."""
    body = {"token_ids": tokens, "model_name": MODEL}
    r = coord.http.post("/directory/lookup", json=body)
    assert r.status_code == 200, r.text
    return [
        {p["instance_id"] for p in res["placements"] if p["tier"] == "l2"}
        for res in r.json()["results"]
    ]


def server_l2_keys(url: str) -> set[str]:
    """The chunk hashes a server's L2 holds, by its own ``GET /cache/objects``."""
    r = httpx.get(f"{url}/cache/objects", params={"tier": "l2", "page_size": 1000}, timeout=10)
    assert r.status_code == 200, r.text
    return {e["key"]["chunk_hash_hex"] for e in r.json()["entries"]}


def kv_client(node: ServerProc) -> CacheClient:
    c = CacheClient(node.engine_url, timeout_s=10.0, engine_id=f"eng-{node.instance_id}")
    c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
    return c


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def coordinator(logs: Path) -> Iterator[KvatlasCoordinator]:
    kv = KvatlasCoordinator(
        logs,
        "--chunk-size",
        str(CHUNK),
        "--eviction-check-interval",
        "0.3",
        "--eviction-ratio",
        "0.5",
    )
    try:
        kv.wait()
        yield kv
    finally:
        kv.stop()


def test_loop_holds_a_salt_under_its_quota_on_lmcache_and_kvatlas_servers(
    lmcache_venv: Path, logs: Path, coordinator: KvatlasCoordinator
) -> None:
    kv = coordinator
    started: list[Any] = []
    client: CacheClient | None = None
    try:
        lm = LMCacheServer(logs, lmcache_venv, "mp-e", kv.url, l2_gb=0.25)
        started.append(lm)
        node = start_server_process(
            logs,
            "kv-e",
            "--coordinator-url", kv.url,
            "--chunk-size", str(CHUNK),
            "--l1-size-gb", str(2**20 / 2**30),
            "--l2-path", str(logs / "l2-kv-e"),
            "--l2-size-gb", "0.05",
            "--event-flush-interval", "0.05",
            "--coordinator-heartbeat-interval", "0.5",
        )  # fmt: skip
        started.append(node)
        lm.wait()
        engine = Engine(logs, lmcache_venv, lm)
        started.append(engine)
        client = kv_client(node)
        wait_until(
            lambda: {i["instance_id"] for i in kv.http.get("/instances").json()["instances"]},
            lambda ids: {"mp-e", "kv-e"} <= ids,
            what="both servers to register",
            timeout=WAIT_S,
        )

        # LMCache: 8 prompts of 2 chunks; the first is pinned.
        lm_prompts = [prompt(100_000 + 10_000 * i, 2) for i in range(8)]
        for p in lm_prompts:
            assert engine.call("store", p)["ok"]
        # kvatlas: 6 prompts of 4 chunks (24 chunks into an L1 of 16: the oldest spill).
        rng = np.random.default_rng(7)
        kv_prompts = [prompt(500_000 + 10_000 * i, 4) for i in range(6)]
        for p in kv_prompts:
            arrays = [rng.integers(0, 256, KV_CHUNK_BYTES, dtype=np.uint8) for _ in range(4)]
            client.store_chunks(p, arrays)
        wait_until(
            lambda: (l2_placements(kv, lm_prompts[-1]), l2_placements(kv, kv_prompts[1])),
            lambda got: all(got[0]) and all(got[1]),
            what="the servers' L2 STORE events",
            timeout=WAIT_S,
        )
        stored = l2_bytes(kv)
        assert stored >= 2 * QUOTA, stored
        for p in (lm_prompts[0], kv_prompts[0]):
            body = {"model_name": MODEL, "world_size": 1, "token_ids": p}
            assert kv.http.post("/cache/pins", json=body).json()["status"] == "pinned"
        pinned_lm = l2_placements(kv, lm_prompts[0])
        pinned_kv = l2_placements(kv, kv_prompts[0])
        assert pinned_lm == [{"mp-e"}] * 2 and pinned_kv == [{"kv-e"}] * 4

        r = kv.http.put("/quota/_default", json={"limit_gb": QUOTA / GIB})
        assert r.status_code == 200, r.text
        usage = wait_until(
            lambda: l2_bytes(kv),
            lambda got: got <= QUOTA,
            what=f"the salt's L2 usage under its quota of {QUOTA} bytes",
            timeout=WAIT_S,
        )
        assert usage > 0
        # The pinned chunks are still held, by the directory's word and the servers'.
        assert l2_placements(kv, lm_prompts[0]) == pinned_lm
        assert l2_placements(kv, kv_prompts[0]) == pinned_kv

        # The kvatlas server's own listing agrees (LMCache's mock L2 cannot list: its
        # DELETE events, which the directory applied, are its word).
        def held() -> tuple[set[str], dict[tuple[str, str], int]]:
            st = kv.http.get("/directory/stats").json()
            owners = {(o["instance_id"], o["tier"]): o["placements"] for o in st["owners"]}
            return server_l2_keys(node.url), owners

        # A sweep planned just before the last events came in may still be deleting.
        kv_keys, by_owner = wait_until(
            held,
            lambda got: got[1].get(("kv-e", "l2")) == len(got[0]),
            what="the kvatlas server's L2 listing to match the directory",
            timeout=WAIT_S,
        )
        kv_hashes = [
            res["key"]["chunk_hash_hex"]
            for res in kv.http.post(
                "/directory/lookup", json={"token_ids": kv_prompts[0], "model_name": MODEL}
            ).json()["results"]
        ]
        assert set(kv_hashes) <= kv_keys
        assert 4 <= len(kv_keys) < 8
        assert 2 <= by_owner[("mp-e", "l2")] < 16
        assert l2_bytes(kv) <= QUOTA
        metrics = kv.http.get("/metrics").text
        assert 'kvatlas_coordinator_eviction_keys_total{result="sent"}' in metrics
        assert 'kvatlas_coordinator_eviction_keys_total{result="failed"}' not in metrics
    finally:
        if client is not None:
            client.close()
        for p in reversed(started):
            p.stop()
