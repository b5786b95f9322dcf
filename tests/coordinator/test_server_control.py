"""`ServerControl` against a real kvatlas server process: deletes split at LMCache's
batch limit, a prefetch and its poll, listing; its error tree for a server that does not
answer, one that refuses (its reason read from ``detail`` or ``error``), and one that
answers something else; and what it reports to ``observe``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvatlas.coordinator.server_control import (
    BadServerAnswer,
    ServerControl,
    ServerRefused,
    ServerTarget,
    ServerUnreachable,
)
from kvatlas.core.keys import ObjectKey, rank_keys
from kvatlas.launch.procs import HOST, free_port
from kvatlas.wire.cache_api import MAX_DELETE_BATCH
from support.cache_fleet import CHUNK, MODEL, Node, data, prompt, start_node


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = start_node(tmp_path, "node-x", None)
    yield n
    assert n.stop() == 0, n.tail()


def target(node: Node) -> ServerTarget:
    return ServerTarget(node.instance_id, HOST, node.http_port)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_big_delete_is_split_at_lmcaches_batch_limit(node: Node) -> None:
    c = node.client()
    tokens = prompt(2, seed=1)
    assert c.store_chunks(tokens, data(2, 1)).stored == 2
    stored = rank_keys(c.hashes(tokens), MODEL, 1)
    absent = [
        ObjectKey(i.to_bytes(32, "big"), MODEL, 16777472) for i in range(MAX_DELETE_BATCH + 5)
    ]
    seen: list[tuple[str, str]] = []

    async def go() -> Any:
        sc = ServerControl(observe=lambda op, outcome, s: seen.append((op, outcome)))
        try:
            return await sc.delete_objects(target(node), absent + stored, tier="all")
        finally:
            await sc.aclose()

    out = run(go())
    assert (out.deleted, out.skipped, out.requests, out.ok) == (2, 0, 2, True)
    assert seen == [("delete", "ok"), ("delete", "ok")]
    assert c.lookup(tokens).hit_chunks == 0


def test_prefetch_poll_and_listing(node: Node) -> None:
    c = node.client()
    tokens = prompt(2, seed=2)
    assert c.store_chunks(tokens, data(2, 2)).stored == 2
    c.store_chunks(prompt(16, seed=3), data(16, 3))  # into L2 with them

    async def go() -> tuple[Any, Any, Any]:
        sc = ServerControl()
        try:
            sub = await sc.submit_prefetch(target(node), MODEL, 1, tokens)
            while (poll := await sc.prefetch_status(target(node), sub.request_id)).status != (
                "completed"
            ):
                await asyncio.sleep(0.05)
            with pytest.raises(ServerRefused) as gone:
                await sc.prefetch_status(target(node), sub.request_id)
            page = await sc.list_objects(target(node), model_name=MODEL, page_size=100)
            return sub, poll, (gone.value, page)
        finally:
            await sc.aclose()

    sub, poll, (gone, page) = run(go())
    assert (sub.status, sub.chunks) == ("submitted", 2)
    assert (poll.found_keys, poll.total_keys) == (2, 2)
    assert gone.status == 404 and "unknown prefetch request_id" in gone.reason
    listed = {e.key.chunk_hash_hex for e in page.entries}
    assert {h.hex() for h in c.hashes(tokens)} <= listed and page.adapter == "disk"


def test_refusals_carry_the_servers_reason(node: Node) -> None:
    bad = [ObjectKey(b"\x01" * 32, "m@x", 16777472)]

    async def go() -> ServerRefused:
        sc = ServerControl()
        try:
            with pytest.raises(ServerRefused) as refused:
                await sc.delete_objects(target(node), bad, tier="l1")
            return refused.value
        finally:
            await sc.aclose()

    refused = run(go())
    assert refused.status == 400 and refused.instance_id == "node-x"
    assert refused.reason == "keys[0]: model_name must not contain '@' (got 'm@x')"


def test_no_answer_and_a_wrong_answer() -> None:
    dead = ServerTarget("dead", HOST, free_port())

    class Garbage(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            body = b'{"unexpected": true}'
            self.send_response(202)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            body = b'{"error": "kvatlas words it so"}'
            self.send_response(503)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer((HOST, 0), Garbage)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    odd = ServerTarget("odd", HOST, srv.server_address[1])
    seen: list[tuple[str, str]] = []

    async def go() -> None:
        sc = ServerControl(timeout_s=2, observe=lambda op, outcome, s: seen.append((op, outcome)))
        try:
            with pytest.raises(ServerUnreachable) as e:
                await sc.submit_prefetch(dead, MODEL, 1, list(range(CHUNK)))
            assert e.value.status == 0 and "dead" in str(e.value)
            with pytest.raises(BadServerAnswer):
                await sc.submit_prefetch(odd, MODEL, 1, list(range(CHUNK)))
            with pytest.raises(ServerRefused) as r:
                await sc.prefetch_status(odd, "x")
            assert (r.value.status, r.value.reason) == (503, "kvatlas words it so")
        finally:
            await sc.aclose()

    try:
        run(go())
    finally:
        srv.shutdown()
        srv.server_close()
    assert seen == [
        ("prefetch", "unreachable"),
        ("prefetch", "bad_answer"),
        ("prefetch_status", "refused"),
    ]


def test_a_target_from_a_registration() -> None:
    assert ServerTarget("a", "::1", 8080).base_url == "http://[::1]:8080"
    assert ServerTarget("a", "10.0.0.2", 80).base_url == "http://10.0.0.2:80"
