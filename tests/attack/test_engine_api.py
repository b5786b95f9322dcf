"""Issue #14, item 1: four engine-API requests whose token is not ASCII killed a server's
engine-API workers (``TypeError`` in the comparison), and the same header made `/status`
and `/metrics` answer 500. Replayed against a real ``kvatlas server``: every such request
is refused, and the server keeps serving the right token afterwards. Also the engine
API's share of item 5: a message over its size limit is refused before it is read.

The gate itself, on every input (hypothesis): ``tests/runtime/test_auth.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from kvatlas.connector.client import CacheClient, Unauthorized
from kvatlas.server.engine_api import MAX_MESSAGE_BYTES
from support.services import ServerProc

from .conftest import BEARER, CHUNK, TOKEN, start_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, token_file: Path) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("engine-api"), "node-secret", token_file)
    yield s
    assert s.stop() == 0, s.text()


def test_non_ascii_tokens_are_refused_and_the_server_keeps_serving(server: ServerProc) -> None:
    s = server  # 2 engine workers
    for path in ("/status", "/metrics"):
        for value in ("Bearer é".encode(), "Bearer é".encode("latin-1"), b"\xff\xfe"):
            r = httpx.get(s.url + path, headers={"Authorization": value}, timeout=5)
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
        ctx.term()
