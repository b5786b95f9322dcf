"""NVIDIA Dynamo 1.6.1's own standalone KV indexer reads a kvatlas server's L1 and L2.

A real ``kvatlas server --kv-events-endpoint`` publishes its tiers as vLLM KV events and
a real ``python -m dynamo.indexer`` subscribes (with the replay endpoint, as a late
joiner). Dynamo rehashes every block's token ids itself, so what it answers on ``/query``
is the proof that kvatlas' blocks carry the right tokens, sizes and parents: a stored
prompt matches in full in its ``cpu`` tier (L1) and, once demoted, its ``disk`` tier
(L2); a deleted chunk stops matching; a salted chunk never matches, with or without the
salt; a chunk stored by hash only is withheld until a lookup shows its tokens. Dynamo's
flat ``scores`` count its device tier only, which kvatlas never claims.

The engine here is a `CacheClient` doing what kvatlas' connector does: a lookup by token
ids (which shows the server the prompt's tokens), then a store of the chunks it missed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.connector.client import CacheClient
from kvatlas.core.keys import pack_kv_rank
from kvatlas.launch.procs import free_ports
from support.services import ServerProc, start_server_process
from support.wait import wait_until

from .conftest import DynamoIndexer

pytestmark = pytest.mark.dynamo

MODEL = "tiny"
CHUNK = 64
BLOCK = 16
CHUNK_BYTES = 64 * 1024
L1_GB = str(16 * CHUNK_BYTES / 2**30)
"""16 chunks: storing 16 more demotes the oldest to L2."""
WORKER = "1"


def tokens_of(chunks: int, seed: int) -> list[int]:
    """``chunks`` full chunks of tokens and one that never is."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 150_000, chunks * CHUNK + 1)]


def data(chunks: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8) for _ in range(chunks)]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ServerProc, str, str]]:
    pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    s = start_server_process(
        tmp_path, "node-d",
        "--chunk-size", str(CHUNK), "--l1-size-gb", L1_GB,
        "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.05",
        "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay,
        "--kv-events-block-size", str(BLOCK),
    )  # fmt: skip
    yield s, pub, replay
    s.stop()


@pytest.fixture
def engine(server: tuple[ServerProc, str, str]) -> Iterator[CacheClient]:
    c = CacheClient(server[0].engine_url, timeout_s=10, engine_id="eng")
    c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
    yield c
    c.close()


@pytest.fixture
def dynamo(
    server: tuple[ServerProc, str, str], start_dynamo_indexer: Callable[..., DynamoIndexer]
) -> DynamoIndexer:
    indexer = start_dynamo_indexer(model=MODEL, block_size=BLOCK)
    indexer.register(int(WORKER), server[1], server[2])
    return indexer


def matched(dynamo: DynamoIndexer, tokens: Sequence[int], salt: str | None = None) -> Any:
    """Dynamo's per-tier breakdown for our worker ({} when nothing matched)."""
    return dynamo.query(tokens, salt)["instances"].get(WORKER, {})


def tiers(cpu: int, disk: int) -> dict[str, Any]:
    """What Dynamo answers for ``cpu`` tokens in L1 and then ``disk`` in L2 (its counts
    are cumulative through the tiers before)."""
    return {"longest_matched": disk, "gpu": 0, "dp": {"0": 0}, "cpu": cpu, "disk": disk}


def metric(server: ServerProc, name: str) -> float:
    m = re.search(rf'^kvatlas_server_kv_events_{name}{{instance_id="node-d"}} (\S+)$',
                  server.metrics(), re.M)  # fmt: skip
    assert m, name
    return float(m.group(1))


def show_and_store(
    engine: CacheClient, tokens: list[int], seed: int, salt: str | None = None
) -> None:
    """What kvatlas' connector does: look the prompt up by token ids, store its chunks."""
    assert engine.lookup(tokens, cache_salt=salt).hit_chunks == 0
    chunks = len(tokens) // CHUNK
    assert engine.store_chunks(tokens, data(chunks, seed), cache_salt=salt).stored == chunks


def test_dynamo_matches_the_tiers_a_real_server_publishes(
    server: tuple[ServerProc, str, str], engine: CacheClient, dynamo: DynamoIndexer
) -> None:
    srv = server[0]
    first = tokens_of(3, seed=1)
    show_and_store(engine, first, seed=1)
    wait_until(
        lambda: (metric(srv, "blocks"), metric(srv, "chunks_withheld_total")),
        lambda m: m == (3 * CHUNK // BLOCK, 0),
        what="the server publishing the chunks its lookup showed (blocks, chunks withheld)",
    )
    want = tiers(cpu=3 * CHUNK, disk=3 * CHUNK)
    wait_until(lambda: matched(dynamo, first), lambda m: m == want, what="3 chunks in L1")
    answer = dynamo.query(first)
    assert answer["scores"] == {}, answer  # Dynamo's flat scores: its device tier only
    # A prompt that shares a chunk and a half: Dynamo counts its own blocks (kvatlas
    # serves the whole chunk only).
    other = first[: CHUNK + CHUNK // 2] + tokens_of(2, seed=9)
    assert matched(dynamo, other) == tiers(cpu=CHUNK + CHUNK // 2, disk=CHUNK + CHUNK // 2)
    assert metric(srv, "blocks_stored_total") == 3 * CHUNK // BLOCK

    # L1 holds 16 chunks: 16 more demote the first prompt's three to L2, Dynamo's disk
    show_and_store(engine, tokens_of(16, seed=2), seed=2)
    want = tiers(cpu=0, disk=3 * CHUNK)
    wait_until(lambda: matched(dynamo, first), lambda m: m == want, what="demotion to L2")

    # deleted: no tier holds them, nothing matches
    hashes = engine.hashes(first)
    r = httpx.request("DELETE", srv.url + "/cache/objects", json={"keys": _keys(hashes)},
                      timeout=10)  # fmt: skip
    assert r.status_code == 200 and r.json()["deleted"] == 3, r.text
    wait_until(lambda: matched(dynamo, first), lambda m: m == {}, what="the deleted chunks gone")

    # a tenant's chunks: published (nothing withheld; the two they push out of L1 are
    # published again in L2) but never matched, salt or no salt
    salted = tokens_of(2, seed=3)
    stored = metric(srv, "blocks_stored_total")
    show_and_store(engine, salted, seed=3, salt="tenant-a")
    wait_until(
        lambda: metric(srv, "blocks_stored_total"),
        lambda n: n == stored + 2 * 2 * CHUNK // BLOCK,
        what="the salted chunks published",
    )
    assert metric(srv, "chunks_withheld_total") == 0
    assert matched(dynamo, salted) == {}
    assert matched(dynamo, salted, salt="tenant-a") == {}

    # stored by hash only: withheld (counted) until a lookup shows the tokens
    by_hash = tokens_of(2, seed=4)
    assert engine.store_chunks(by_hash, data(2, 4)).stored == 2
    wait_until(lambda: metric(srv, "chunks_withheld_total"), lambda n: n == 2, what="withheld")
    assert metric(srv, "unpublished_chunks") == 2
    assert matched(dynamo, by_hash) == {}
    assert engine.lookup(by_hash).hit_chunks == 2
    want = tiers(cpu=2 * CHUNK, disk=2 * CHUNK)
    wait_until(lambda: matched(dynamo, by_hash), lambda m: m == want, what="shown, published")
    assert metric(srv, "unpublished_chunks") == 0
    assert dynamo.proc.poll() is None, dynamo.tail()


def _keys(hashes: Sequence[bytes]) -> list[dict[str, Any]]:
    rank = pack_kv_rank(1, 0, 1, 0)
    return [
        {"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": rank, "cache_salt": ""}
        for h in hashes
    ]
