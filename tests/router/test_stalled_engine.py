"""An engine whose probe answers while its work is stuck (a hung model thread: its
``/metrics`` answers, its token counters stand still, no answer comes) costs no request:
past its first-byte deadline the requests that wait for their first byte go to their
next choice, and a stream it had begun ends with an error event naming the cause.

The stuck engine is a socket server in this process (no real engine can be made to hang
its model thread alone); the engine that answers instead is a real reference engine.
The router keeps its default 600 s ``--engine-timeout`` and probes every 0.2 s. The
evidence that the first-byte deadline (its floor, 1 s here) moved the requests is the
router's own, not the wall clock: its deadline and retry counters, the stall it reports
for the engine (how long it was silent, past which deadline), the route header. The one
wall-clock bound is a hang guard: the clients' timeout, far below the engine timeout a
request would wait without the deadline."""

from __future__ import annotations

import concurrent.futures
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvatlas.engine.engine_app import EngineApp
from kvatlas.engine.model import LoadedModel
from kvatlas.launch.procs import HOST
from kvatlas.router.app import RouterApp
from kvatlas.router.config import StaticEngine
from support.wait import wait_until

from .conftest import (
    StartRouter,
    engine_in_process,
    metric_value,
    retried,
    route,
)
from .test_router import available, chat

FLOOR_S = 1.0
HANG_S = 120.0
"""The clients' timeout: a request left on the stuck engine until the router's 600 s
``--engine-timeout`` fails with it, whatever the machine's load."""
SILENT_BOUND_S = 30.0
"""The most silence the router may report before it acted on a 1 s deadline: 30 times
the deadline, to catch a deadline that never fires, not a slow probe loop."""
STALL = re.compile(r"no progress in ([\d.]+) s .*first-byte deadline: ([\d.]+) s")


def _stall(router: RouterApp, url: str) -> tuple[float, float]:
    """The stall the router reports for the engine at ``url``: how long it was silent
    when the deadline took it out, and that deadline."""
    out = next(e for e in router.status().engines if e.url == url)
    m = STALL.search(out.last_error)
    assert m, out.last_error
    return float(m.group(1)), float(m.group(2))


class StuckEngine:
    """A fake engine on 127.0.0.1: ``/metrics`` answers 200 with token counters that never
    move; a streamed request whose body says ``"begun"`` gets a stream's head and one
    event, then nothing; any other request gets nothing. Connections stay open until
    ``close``."""

    METRICS = (
        b"kvatlas_engine_requests_running 1\n"
        b"kvatlas_engine_prefilled_tokens_total 100\n"
        b"kvatlas_engine_generation_tokens_total 5\n"
    )

    def __init__(self) -> None:
        self._sock = socket.create_server((HOST, 0))
        self.url = f"http://{HOST}:{self._sock.getsockname()[1]}"
        self._closed = threading.Event()
        self.held = 0
        """Requests it took and never answered."""
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while not self._closed.is_set():
                try:
                    more = conn.recv(65536)
                except OSError:
                    return
                if not more:
                    return
                data += more
                head, sep, body = data.partition(b"\r\n\r\n")
                if not sep:
                    continue
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                if length and len(body) < int(length.group(1)):
                    continue
                data = body[int(length.group(1)) :] if length else body
                if head.split(b" ")[1:2] == [b"/metrics"]:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(self.METRICS)
                        + self.METRICS
                    )
                    continue
                self.held += 1
                if b'"begun"' in body:
                    event = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n"
                        + b"%x\r\n" % len(event)
                        + event
                        + b"\r\n"
                    )
                self._closed.wait()  # stuck: the connection stays open, nothing comes
                return

    def close(self) -> None:
        self._closed.set()
        self._sock.close()


@pytest.fixture
def stuck() -> Iterator[StuckEngine]:
    engine = StuckEngine()
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def steady(tiny: LoadedModel) -> Iterator[EngineApp]:
    with engine_in_process(tiny) as app:
        yield app


def test_requests_waiting_on_a_stuck_engine_go_to_their_next_choice(
    stuck: StuckEngine, steady: EngineApp, start_router: StartRouter
) -> None:
    router = start_router(
        engines=(StaticEngine(stuck.url, "s"), StaticEngine(steady.url, "y")),
        policy="round-robin",
        first_byte_floor_s=FLOOR_S,
        breaker_open_s=60.0,
    )
    wait_until(lambda: len(available(router)), lambda n: n == 2, what="both engines")
    assert metric_value(router.url, "kvatlas_router_engine_first_byte_deadline_seconds",
                   engine=stuck.url) == FLOOR_S  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(
                lambda i: httpx.post(
                    f"{router.url}/v1/chat/completions", json=chat(f"q {i}"), timeout=HANG_S
                ),
                range(6),
            )
        )
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
    assert all(route(a)["engine"] == steady.url for a in answers), [route(a) for a in answers]
    moved = sum(retried(a) for a in answers)
    assert moved == stuck.held >= 1, (moved, stuck.held)
    # round-robin sends it work only until it is out: once out, it stays out (60 s);
    # the first-byte deadline took it out, once, and moved every request it held
    assert (
        metric_value(router.url, "kvatlas_router_first_byte_deadlines_total", engine=stuck.url) == 1
    )
    assert metric_value(router.url, "kvatlas_router_breaker_opens_total", engine=stuck.url) == 1
    assert (
        metric_value(router.url, "kvatlas_router_retries_total", engine=stuck.url, cause="stalled")
        == moved
    )
    assert metric_value(router.url, "kvatlas_router_retries_total", engine=stuck.url) == moved
    silent_s, deadline_s = _stall(router, stuck.url)
    assert deadline_s == FLOOR_S <= silent_s < SILENT_BOUND_S, (silent_s, deadline_s)
    out = next(e for e in router.status().engines if e.url == stuck.url)
    assert not out.available and out.in_flight == 0, out


def test_a_stream_begun_on_a_stuck_engine_ends_with_an_error_naming_the_cause(
    stuck: StuckEngine, start_router: StartRouter
) -> None:
    router = start_router(engines=(StaticEngine(stuck.url, "s"),), first_byte_floor_s=FLOOR_S)
    wait_until(lambda: len(available(router)), lambda n: n == 1, what="the engine")
    body = {"messages": [{"role": "user", "content": "begun"}], "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=HANG_S) as s:
        assert s.status_code == 200
        assert route(s)["engine"] == stuck.url
        lines = [line for line in s.iter_lines() if line]
    took = time.monotonic() - t0
    assert lines[0].startswith("data: ") and '"content": "a"' in lines[0], lines
    assert len(lines) == 2 and "stopped answering (stalled)" in lines[1], lines
    assert '"upstream_error"' in lines[1], lines
    # cut by the deadline, not before it (load only makes the wait longer): the router
    # says it waited out the 1 s floor, and the client waited at least that
    silent_s, deadline_s = _stall(router, stuck.url)
    assert deadline_s == FLOOR_S <= silent_s < SILENT_BOUND_S, (silent_s, deadline_s)
    assert took >= FLOOR_S, took
    assert (
        metric_value(router.url, "kvatlas_router_first_byte_deadlines_total", engine=stuck.url) == 1
    )
    assert (
        metric_value(router.url, "kvatlas_router_stream_failures_total", engine=stuck.url,
                cause="stalled") == 1
    )  # fmt: skip
