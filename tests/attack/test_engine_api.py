"""Four engine-API requests whose token is not ASCII killed a server's
engine-API workers (``TypeError`` in the comparison), and the same header made `/status`
and `/metrics` answer 500. Replayed against a real ``kvatlas server``: every such request
is refused, and the server keeps serving the right token afterwards. Also oversized
and flooding clients on the engine API: a message over its size limit is refused
before it is read, and an engine that sends requests faster than they are served
(without reading the answers) gets the excess answered ``overloaded`` at once, holds a
bounded share of the queue and of the server's memory, and leaves other engines'
local hits answered.

The gate itself, on every input (hypothesis): ``tests/runtime/test_auth.py``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq

from kvatlas.connector.client import CacheClient, ServerOverloaded, Unauthorized
from kvatlas.connector.kv_connector import Fallback, KVConnector
from kvatlas.core.keys import HashContract
from kvatlas.server.engine_api import MAX_MESSAGE_BYTES
from kvatlas.wire.engine_proto import (
    PROTOCOL_VERSION,
    ErrorReply,
    Lookup,
    LookupResult,
    Request,
    decode_response,
    encode,
)
from support.services import ServerProc

from .conftest import BEARER, CHUNK, TOKEN, client, rss_bytes, start_server

MODEL = "tiny"
LAYOUT = (2, 2, 8)
MAX_QUEUED = 8
PER_CLIENT = 4
FLOOD = 300
"""Requests each flooding socket sends without reading an answer."""
FLOOD_TOKENS = 64 * 1024
"""Token ids per flooding lookup: 256 KiB each, hashed by the server (work that takes a
worker a while), so FLOOD of them are 75 MiB the server would hold if it queued them all."""
HOLD_TOKENS = 2 * 2**20
"""Token ids per lookup that holds a place in a full queue: 8 MiB, which the one worker
hashes for a hundred milliseconds or more, so the queue stays full well past the time an
honest request takes to arrive (a 256 KiB lookup frees its place within milliseconds, and
a loaded machine delivered the honest request after it)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("engine-api"), "node-secret", token_file)
    yield s
    assert s.stop() == 0, s.text()


def test_non_ascii_tokens_are_refused_and_the_server_keeps_serving(server: ServerProc) -> None:
    s = server  # 2 engine workers
    for path in ("/status", "/metrics"):
        for value in ("Bearer é".encode(), "Bearer é".encode("latin-1"), b"\xff\xfe"):
            r = httpx.get(s.url + path, headers={b"Authorization": value}, timeout=5)
            assert r.status_code == 401, (path, value, r.text)
    for _ in range(4):  # more than the workers
        bad = CacheClient(s.engine_url, timeout_s=5.0, auth_token="é")
        with pytest.raises(Unauthorized):
            bad.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        bad.close()
    trusted = CacheClient(s.engine_url, timeout_s=5.0, auth_token=TOKEN)
    trusted.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
    assert trusted.lookup(list(range(CHUNK))).hit_tokens == 0
    trusted.close()
    assert httpx.get(f"{s.url}/status", headers=BEARER, timeout=5).status_code == 200


def test_huge_engine_messages_are_dropped_unread_and_engines_answered(
    server: ServerProc,
) -> None:
    """An engine-API message had no size limit: three of 48 MB were read whole (and
    answered) before anything else. Now ZeroMQ refuses one over MAX_MESSAGE_BYTES from
    its size header and cuts the sender off, and engines are answered meanwhile."""
    s = server
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    try:
        big.connect(s.engine_url)
        for _ in range(3):
            big.send_multipart([b"", b"\x00" * (MAX_MESSAGE_BYTES + 1)])
        trusted = CacheClient(s.engine_url, timeout_s=5.0, auth_token=TOKEN)
        t0 = time.monotonic()
        trusted.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        assert trusted.lookup(list(range(CHUNK))).hit_tokens == 0
        assert time.monotonic() - t0 < 5
        trusted.close()
        assert big.poll(1000, zmq.POLLIN) == 0  # no answer: the sender was cut off
    finally:
        big.close(0)
        ctx.destroy(linger=0)  # closes what a failed assertion left open; never blocks


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[ServerProc]:
    """A server with one engine worker and small bounds on the requests it holds."""
    s = start_server(
        tmp_path_factory.mktemp("engine-queue"), "node-queue", token_file,
        "--engine-workers", "1", "--engine-max-queued", str(MAX_QUEUED),
        "--engine-max-queued-per-client", str(PER_CLIENT),
    )  # fmt: skip
    yield s
    assert s.stop() == 0, s.text()


def _flooder(ctx: zmq.Context[zmq.Socket[bytes]], url: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    return sock


def _burst(
    sock: zmq.Socket[bytes],
    ns_client: CacheClient,
    n: int,
    first_id: int = 1,
    tokens_n: int = FLOOD_TOKENS,
) -> int:
    """Send ``n`` heavy lookups of ``tokens_n`` tokens at once, reading nothing; the
    number sent."""
    assert ns_client.ns is not None
    tokens = np.arange(tokens_n, dtype="<u4").tobytes()
    body = Lookup(ns_client.ns, token_ids=tokens)
    for i in range(n):
        sock.send_multipart([b"", encode(Request(PROTOCOL_VERSION, first_id + i, body, TOKEN))])
    return n


def _answers(sock: zmq.Socket[bytes], n: int, deadline_s: float) -> tuple[int, int]:
    """Read ``n`` answers: (served, overloaded)."""
    served = overloaded = 0
    end = time.monotonic() + deadline_s
    while served + overloaded < n:
        left_ms = int((end - time.monotonic()) * 1000)
        assert left_ms > 0 and sock.poll(left_ms, zmq.POLLIN), (served, overloaded)
        body = decode_response(sock.recv_multipart()[-1]).body
        if isinstance(body, ErrorReply):
            assert body.code == "overloaded", body
            overloaded += 1
        else:
            assert isinstance(body, LookupResult), body
            served += 1
    return served, overloaded


def _metric(s: ServerProc, name: str) -> float:
    with client(s) as c:
        text = c.get("/metrics").text
    m = re.search(rf"^kvatlas_server_{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def test_a_flooding_engine_is_answered_overloaded_and_others_still_hit(
    bounded: ServerProc,
) -> None:
    """The engine API queued every request it read, without a bound: an engine sending
    faster than the workers answer grew the server's memory without limit and put every
    other engine's local hit behind its flood. Now the flood holds PER_CLIENT requests at
    most, the rest are answered ``overloaded`` at once, the server's memory stays, and an
    honest engine's local hit is answered meanwhile."""
    s = bounded
    trusted = CacheClient(s.engine_url, timeout_s=10.0, auth_token=TOKEN)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        trusted.register(MODEL, "float16", LAYOUT, chunk_size=CHUNK)
        prompt = list(range(1000, 1000 + CHUNK))
        stored = trusted.store_chunks(prompt, [np.ones(1024, np.uint8)])
        assert stored.stored == 1
        rss0 = rss_bytes(s.pid)
        flood = _flooder(ctx, s.engine_url)
        _burst(flood, trusted, FLOOD)
        t0 = time.monotonic()
        assert trusted.lookup(prompt).hit_tokens == CHUNK
        hit_s = time.monotonic() - t0
        peak = rss_bytes(s.pid)
        served, overloaded = _answers(flood, FLOOD, 120)
        peak = max(peak, rss_bytes(s.pid))
        flood.close(0)
        assert hit_s < 10, hit_s
        assert overloaded > 0 and served >= 1, (served, overloaded)
        # unbounded, the server held most of FLOOD x 256 KiB = 75 MiB at once
        assert peak - rss0 < 30 * 2**20, (rss0, peak)
        assert _metric(s, "engine_requests_overloaded_total") >= overloaded
        assert _metric(s, "engine_requests_queued") == 0
    finally:
        trusted.close()
        ctx.destroy(linger=0)  # closes what a failed assertion left open; never blocks


def test_a_full_queue_makes_the_connector_recompute_not_fail(bounded: ServerProc) -> None:
    """With every place held by flooding sockets, a connector's lookup is answered
    ``overloaded``: it falls back to recomputing (cause ``server_overloaded``), stays
    connected, and the plain client raises ``ServerOverloaded``, a ``RequestRefused``."""
    s = bounded
    contract = HashContract(MODEL, CHUNK, kv_dtype="float16", kv_layout=LAYOUT)
    conn = KVConnector(contract, CacheClient(s.engine_url, auth_token=TOKEN), timeout_s=10.0)
    plain = CacheClient(s.engine_url, timeout_s=10.0, auth_token=TOKEN)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        assert conn.register()
        plain.register(MODEL, "float16", LAYOUT, chunk_size=CHUNK)
        floods = [_flooder(ctx, s.engine_url) for _ in range(MAX_QUEUED // PER_CLIENT)]
        sent = [0] * len(floods)

        def burst() -> None:
            """Just before each honest request: every flooding socket fills its share
            (one more than it may hold, in case a place frees meanwhile) until the server
            reports the whole queue held. Each held lookup takes the one worker long
            enough that the queue is still full when the honest request arrives."""
            end = time.monotonic() + 30
            while True:
                for i, f in enumerate(floods):
                    sent[i] += _burst(f, plain, PER_CLIENT + 1, sent[i] + 1, HOLD_TOKENS)
                polled = time.monotonic() + 0.5
                while time.monotonic() < polled:
                    if _metric(s, "engine_requests_queued") >= MAX_QUEUED:
                        return
                    time.sleep(0.002)
                # sent into a queue still full of the last burst: refused, so send again
                assert time.monotonic() < end, "the flood never filled the queue"

        causes = []
        for _ in range(20):  # a place freed in between is fine, once or twice
            burst()
            with conn.fetch_prefix(list(range(2 * CHUNK))) as prefix:
                causes.append(prefix.stats.fallback)
            if Fallback.SERVER_OVERLOADED in causes:
                break
        assert Fallback.SERVER_OVERLOADED in causes, causes
        assert conn.connected
        assert conn.stats().fallbacks[Fallback.SERVER_OVERLOADED] >= 1
        with pytest.raises(ServerOverloaded):
            for _ in range(20):
                burst()
                plain.lookup(list(range(CHUNK)))
        for f, n in zip(floods, sent, strict=True):
            _answers(f, n, 300)
            f.close(0)
        assert plain.lookup(list(range(CHUNK))).hit_tokens == 0  # served again
    finally:
        conn.close()
        plain.close()
        ctx.destroy(linger=0)  # closes what a failed assertion left open; never blocks
