"""The engine's KVConnector against a real cache server process (tiny random model).

Covers the load and store paths through the shared L1 region, the correctness rule (a
prefix loaded from the cache gives the same greedy output as a full recompute), checksum
verification, contract refusal, and the ``recompute`` failure policy: a cache server that
is killed, or not there yet, costs a recompute, never a failed request; the engine
registers again once a server answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from kvatlas.connector.client import CacheClient
from kvatlas.connector.kv_connector import (
    ContractRejected,
    Fallback,
    KVConnector,
)
from kvatlas.engine.config import CacheLinkConfig, EngineConfig
from kvatlas.engine.engine_app import EngineApp
from kvatlas.engine.generate import SamplingParams, prefill_and_generate
from kvatlas.engine.model import LoadedModel, load_model
from kvatlas.launch.procs import free_port
from support.services import ServerProc
from support.wait import wait_until

from .conftest import StartCacheServer

CHUNK = 256
GREEDY = SamplingParams(max_new_tokens=16, stop_token_ids=())


def document(lines: int = 40) -> str:
    return "\n".join(f"{i}. Line {i} of the shared document, about caches." for i in range(lines))


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "kv_transfer_params": {"cached_token_stats": True},
        **extra,
    }


def connector_for(model: LoadedModel, server: ServerProc, **kw: Any) -> KVConnector:
    client = CacheClient(server.engine_url, timeout_s=2.0, engine_id="test-engine")
    return KVConnector(model.contract(CHUNK), client, timeout_s=2.0, **kw)


@contextmanager
def engine(model: LoadedModel, cache_port: int | None, **kw: Any) -> Iterator[EngineApp]:
    cache = None
    if cache_port is not None:
        cache = CacheLinkConfig(port=cache_port, timeout_s=0.5, reconnect_interval_s=0.2)
    config = EngineConfig(model="tiny-random", port=0, cache=cache, **kw)
    app = EngineApp(config, model=model)
    app.start()
    try:
        yield app
    finally:
        app.stop()


def ask(app: EngineApp, body: dict[str, Any], expect: int = 200) -> dict[str, Any]:
    r = httpx.post(f"{app.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == expect, r.text
    return dict(r.json())


def wait_connected(app: EngineApp) -> None:
    wait_until(
        lambda: app.connector is not None and app.connector.connected,
        what="the engine connected to its cache server",
        timeout=10,
    )


# ----------------------------------------------------------------------------- connector


def test_store_then_load_through_the_region_gives_the_same_greedy_output(
    tiny: LoadedModel, start_cache_server: StartCacheServer
) -> None:
    server = start_cache_server()
    conn = connector_for(tiny, server)
    try:
        assert conn.start()
        ids = tiny.tokenizer.encode(document())  # ~2 000 tokens: 7 full chunks
        n_full = len(ids) // CHUNK
        with conn.fetch_prefix(ids) as miss:
            assert (miss.chunks, miss.stats.fallback, miss.stats.asked_chunks) == ([], None, n_full)
        full = prefill_and_generate(tiny, ids, None, params=GREEDY)
        conn.observe_prefill(full.prefilled_tokens, full.prefill_s)
        assert conn.recompute_estimate(CHUNK) > 0
        out = conn.store_new(ids, full.first_new_chunk, full.new_chunks)
        assert (out.stored, out.existing, out.skipped) == (n_full, 0, 0)
        assert server.status()["l1"]["chunks"] == n_full
        # again: everything exists already
        assert conn.store_new(ids, 0, full.new_chunks[:2]).existing == 2

        with conn.fetch_prefix(ids) as hit:
            assert hit.stats.hit_chunks == n_full and hit.stats.fallback is None
            # zero-copy views of the server's slots, byte-equal to what was stored
            assert all(
                np.array_equal(a, b) for a, b in zip(hit.chunks, full.new_chunks, strict=True)
            )
            assert server.status()["leases"]["read"] == n_full
            reused = prefill_and_generate(tiny, ids, hit.chunks, params=GREEDY)
        assert server.status()["leases"]["read"] == 0
        assert reused.cached_tokens == n_full * CHUNK
        assert reused.token_ids == full.token_ids and reused.text == full.text

        # a shorter prompt sharing the first chunks hits only those
        with conn.fetch_prefix(ids[: 3 * CHUNK + 10]) as part:
            assert part.stats.hit_chunks == 3
        assert conn.stats().hit_chunks == n_full + 3
        # the engine's measured prefill rate travels with its lookups: the server learns
        # it, for lookups that come without an estimate
        rates = server.status()["lookups"]["recompute_s_per_token"]
        assert list(rates.values()) == [pytest.approx(conn.stats().prefill_s_per_token)]
    finally:
        conn.close()


def test_corrupt_chunk_is_dropped_and_recomputed(
    tiny: LoadedModel, start_cache_server: StartCacheServer
) -> None:
    server = start_cache_server()
    conn = connector_for(tiny, server, verify_checksums=True)  # the engine's optional pass
    try:
        assert conn.start()
        ids = tiny.tokenizer.encode(document(20))  # ~1 000 tokens: 3 full chunks
        full = prefill_and_generate(tiny, ids, None, params=GREEDY)
        assert conn.store_new(ids, 0, full.new_chunks).stored == 3
        with conn.fetch_prefix(ids) as hit:
            # flip bytes of the second chunk in the shared region (a bad write, a bad
            # peer read): its checksum no longer matches
            hit.chunks[1][100:108] ^= 0xFF
        with conn.fetch_prefix(ids) as prefix:
            assert prefix.stats.fallback == Fallback.CHECKSUM_MISMATCH
            assert prefix.stats.hit_chunks == 1  # the prefix ends before the bad chunk
            reused = prefill_and_generate(tiny, ids, prefix.chunks, params=GREEDY)
        assert reused.cached_tokens == CHUNK
        assert reused.token_ids == full.token_ids
        assert conn.stats().fallbacks == {Fallback.CHECKSUM_MISMATCH: 1}
    finally:
        conn.close()


def test_a_contradicting_contract_fails_loudly_naming_the_field(
    tiny: LoadedModel, start_cache_server: StartCacheServer
) -> None:
    server = start_cache_server()
    first = connector_for(tiny, server)
    # the same model name with another KV dtype: its bytes would be garbage to the fleet
    half = load_model("tiny-random", dtype="float16")
    second = connector_for(half, server)
    try:
        assert first.register()
        with pytest.raises(ContractRejected, match="kv_dtype"):
            second.register()
        assert not second.connected
    finally:
        first.close()
        second.close()


# ----------------------------------------------------------------------------- engine


def test_engine_second_request_loads_the_prefix_and_answers_the_same(
    tiny: LoadedModel, start_cache_server: StartCacheServer
) -> None:
    server = start_cache_server()
    body = chat_body(document())
    with engine(tiny, server.port) as app:
        first = ask(app, body)
        stats1 = first["cached_token_stats"]
        n_prompt = stats1["num_prompt_tokens"]
        n_full = n_prompt // CHUNK
        assert stats1["num_cached_tokens"] == 0 and stats1["fallback"] is None
        assert stats1["num_prefilled_tokens"] == n_prompt
        assert server.status()["l1"]["chunks"] == n_full

        second = ask(app, body)
        stats2 = second["cached_token_stats"]
        assert stats2["num_cached_tokens"] == n_full * CHUNK
        assert stats2["num_prefilled_tokens"] == n_prompt - n_full * CHUNK
        assert stats2["num_peer_cached_tokens"] == 0 and stats2["fallback"] is None
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n_full * CHUNK
        assert second["choices"][0]["message"] == first["choices"][0]["message"]
        assert server.status()["leases"]["read"] == 0
        metrics = httpx.get(f"{app.url}/metrics").text
        assert f"kvatlas_engine_cached_tokens_total {float(n_full * CHUNK)}" in metrics
        assert "kvatlas_engine_cache_connected 1.0" in metrics

    # the same request on an engine without any cache: a full recompute, the same answer
    with engine(tiny, None) as plain:
        again = ask(plain, body)
    assert again["cached_token_stats"]["num_cached_tokens"] == 0
    assert again["choices"][0]["message"] == first["choices"][0]["message"]


def test_killed_cache_server_costs_a_recompute_then_the_engine_reconnects(
    tiny: LoadedModel, start_cache_server: StartCacheServer
) -> None:
    server = start_cache_server()
    body = chat_body(document(20))
    with engine(tiny, server.port) as app:
        first = ask(app, body)
        assert ask(app, body)["cached_token_stats"]["num_cached_tokens"] > 0

        server.kill()
        down = ask(app, body)
        assert down["cached_token_stats"]["fallback"] == Fallback.SERVER_UNAVAILABLE
        assert down["cached_token_stats"]["num_cached_tokens"] == 0
        assert down["choices"] == first["choices"]
        # no more waiting on a dead server: the next request skips the cache at once (its
        # load time, not the recompute that follows, is what a wait on the 0.5 s lookup
        # timeout would show)
        skipped = ask(app, body)["cached_token_stats"]
        assert skipped["fallback"] == Fallback.SERVER_UNAVAILABLE
        assert skipped["load_ms"] < 250, skipped
        assert httpx.get(f"{app.url}/healthz").json()["cache"] == "disconnected"
        metrics = httpx.get(f"{app.url}/metrics").text
        assert 'kvatlas_engine_kv_load_fallbacks_total{cause="server_unavailable"} 2.0' in metrics

        # a new server on the same port: the engine registers again and stores anew
        start_cache_server(port=server.port)
        assert app.connector is not None
        wait_connected(app)
        assert ask(app, body)["cached_token_stats"]["fallback"] is None
        back = ask(app, body)
        assert back["cached_token_stats"]["num_cached_tokens"] > 0
        assert back["choices"] == first["choices"]
        assert app.connector.stats().reconnects == 1


def test_engine_starts_without_its_cache_server_and_connects_later(
    tiny: LoadedModel, start_cache_server: StartCacheServer
) -> None:
    port = free_port()
    body = chat_body(document(12))
    with engine(tiny, port) as app:
        alone = ask(app, body)
        assert alone["cached_token_stats"]["fallback"] == Fallback.SERVER_UNAVAILABLE
        start_cache_server(port=port)
        wait_connected(app)
        ask(app, body)
        assert ask(app, body)["cached_token_stats"]["num_cached_tokens"] > 0


def test_fail_policy_answers_503_when_the_cache_is_down(tiny: LoadedModel) -> None:
    with engine(tiny, free_port(), kv_load_failure_policy="fail") as app:
        err = ask(app, chat_body(document(12)), expect=503)
        assert err["error"]["code"] == "kv_load"
        assert Fallback.SERVER_UNAVAILABLE in err["error"]["message"]
        # a prompt shorter than a chunk needs no cache: it is served
        assert ask(app, chat_body("hi"))["cached_token_stats"]["fallback"] is None
