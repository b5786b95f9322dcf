"""An engine that freezes (SIGSTOP: its sockets stay open, nothing answers) costs no
request, and one that is only busy is not failed over; a coordinator that freezes costs
no request either, and after the first lookup that finds it out no request waits on it.

A real reference engine runs as a process of its own (it is frozen and resumed with
signals); the other is in this process. The router probes every 0.2 s with a 1 s probe
timeout, and keeps its default 600 s ``--engine-timeout``: every bound below is the
probe's, not the timeout's. The coordinator is a real one, in a process of its own.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvatlas.engine.engine_app import EngineApp
from kvatlas.engine.model import LoadedModel
from kvatlas.launch.procs import HOST
from kvatlas.router.app import RouterApp
from kvatlas.router.config import StaticEngine
from kvatlas.router.tripwires import COORDINATOR
from support.launch import Proc
from support.services import start_coordinator_process
from support.wait import wait_until

from .conftest import (
    StartRouter,
    engine_in_process,
    engine_process,
    metric_value,
    retried,
    route,
)
from .test_router import available, chat

pytestmark = pytest.mark.slow
"""A reference engine process frozen and resumed, and a coordinator process: about 75 s
in all measured on the 2-core VM (its fixtures 25 s up and 15 s down, 6 to 7 s a test;
load average 5 to 11)."""

HEALTH_S = 0.2
PROBE_TIMEOUT_S = 1.0
BUSY_PROBE_TIMEOUT_S = 15.0
"""The busy test's probe timeout: what it proves is that a probe that answers keeps a
busy engine in, so a probe that answers late on a loaded machine (its engine and the
router share two cores with a prefill) must still count as an answer there."""
BOUND_S = 30.0
"""Freeze to answer, generously (a loaded 2-core machine): far below the 600 s timeout."""
LONG_PROMPT = [5 + i % 200 for i in range(1800)]
"""A prompt the reference engine takes seconds to prefill on a CPU."""
BLOCKER_TOKENS = 1600
"""Completion tokens of the answer a frozen engine is working on when it freezes: a few
seconds of decoding, so that it cannot end before the freeze however fast the machine
(at 400 tokens, capped at 248 by a 2,048-token context, a fast machine finished it
within the half second the test waits before SIGSTOP)."""
BLOCKER_LEN = len(LONG_PROMPT) + BLOCKER_TOKENS + 64
"""Both engines' context: the blocker fits whole, on either (it is retried)."""


@pytest.fixture(scope="module")
def frozen_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    log = tmp_path_factory.mktemp("failover") / "frozen.log"
    with engine_process(log, "--max-model-len", str(BLOCKER_LEN)) as p:
        yield p


@pytest.fixture(scope="module")
def steady(tiny: LoadedModel) -> Iterator[EngineApp]:
    with engine_in_process(tiny, max_model_len=BLOCKER_LEN) as app:
        yield app


def _router(
    start_router: StartRouter,
    frozen: Proc,
    steady: EngineApp,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
) -> RouterApp:
    router = start_router(
        engines=(StaticEngine(frozen.url, "x"), StaticEngine(steady.url, "y")),
        policy="round-robin",
        health_interval_s=HEALTH_S,
        probe_timeout_s=probe_timeout_s,
    )
    wait_until(lambda: len(available(router)), lambda n: n == 2, what="both engines", timeout=60)
    # round-robin: after an answer from the steady engine, the next request goes to the other
    while route(_post(router, chat("warm up")))["engine"] != steady.url:
        pass
    return router


def _post(
    router: RouterApp, body: dict[str, Any], path: str = "chat/completions", **kw: Any
) -> httpx.Response:
    r = httpx.post(f"{router.url}/v1/{path}", json=body, timeout=120, **kw)
    assert r.status_code == 200, r.text
    return r


def _stream(
    router: RouterApp, body: dict[str, Any], path: str = "chat/completions"
) -> tuple[httpx.Headers, list[str]]:
    """A streamed request's headers and its events' lines."""
    with httpx.stream("POST", f"{router.url}/v1/{path}", json=body, timeout=120) as s:
        assert s.status_code == 200, s.read()
        return s.headers, [line for line in s.iter_lines() if line]


def _engine(router: RouterApp, url: str) -> Any:
    return next(e for e in router.status().engines if e.url == url)


def test_a_busy_engine_is_not_failed_over(
    frozen_one: Proc, steady: EngineApp, start_router: StartRouter
) -> None:
    """A long prefill, a request queued behind it and a slow stream on one engine: its
    probe answers while it works, so all three are its own to the end. The evidence is
    the router's own: which engine answered, no retry, no stream cut, no probe failure
    and no first-byte deadline counted against it (a probe that timed out would say
    ``no answer`` in its last error and retry its requests as ``frozen``)."""
    router = _router(start_router, frozen_one, steady, probe_timeout_s=BUSY_PROBE_TIMEOUT_S)
    busy = frozen_one.url
    long = {"prompt": LONG_PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    seen: list[tuple[bool, int, str]] = []
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(_post, router, long, "completions")
        wait_until(lambda: _engine(router, busy).in_flight, what="the long prefill is sent")
        pool.submit(_post, router, chat("keep me busy")).result()  # the steady engine's turn
        queued = pool.submit(_post, router, chat("queued behind it", max_tokens=8))
        wait_until(lambda: _engine(router, busy).in_flight == 2, what="one queued behind it")
        while not (first.done() and queued.done()):  # a sample every half probe interval
            e = _engine(router, busy)
            seen.append((e.available, e.reported_running, e.last_error))
            concurrent.futures.wait((first, queued), timeout=HEALTH_S / 2)
        answers = [first.result(), queued.result()]
    assert [route(a)["engine"] for a in answers] == [busy, busy], [route(a) for a in answers]
    assert not any(retried(a) for a in answers)
    assert all(ok for ok, _, _ in seen), ("the busy engine was taken out", seen[-3:])
    assert any(running >= 1 for _, running, _ in seen), "no probe answered while it worked"
    # a stream that is slow, not stuck, runs to its end
    body = chat("a slow story", max_tokens=24, stream=True)
    while route(_post(router, chat("turn"))).get("engine") != steady.url:
        pass
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=120) as s:
        assert route(s)["engine"] == busy
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and not any("error" in line for line in lines)
    assert metric_value(router.url, "kvatlas_router_retries_total", engine=busy) == 0
    assert metric_value(router.url, "kvatlas_router_stream_failures_total", engine=busy) == 0
    assert metric_value(router.url, "kvatlas_router_first_byte_deadlines_total", engine=busy) == 0
    assert metric_value(router.url, "kvatlas_router_breaker_opens_total", engine=busy) == 0
    assert _engine(router, busy).last_error == "", _engine(router, busy).last_error


def test_a_frozen_engine_costs_no_request_and_comes_back(
    frozen_one: Proc, steady: EngineApp, start_router: StartRouter
) -> None:
    router = _router(start_router, frozen_one, steady)
    frozen = frozen_one.url
    long = chat("tell a long story", max_tokens=1500, stream=True)
    try:
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=long, timeout=120) as s:
            assert route(s)["engine"] == frozen
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                # round-robin: two to each engine; the frozen one's wait behind the stream
                futures = [
                    pool.submit(_post, router, chat(f"question {i}", max_tokens=4))
                    for i in range(4)
                ]
                wait_until(
                    lambda: _engine(router, frozen).in_flight,
                    lambda n: n == 3,
                    what="two requests wait behind the stream",
                )
                os.kill(frozen_one.pid, signal.SIGSTOP)
                frozen_at = time.monotonic()
                answers = [f.result() for f in futures]
                answered_s = time.monotonic() - frozen_at
            rest = list(lines)
            cut_s = time.monotonic() - frozen_at
        assert answered_s < BOUND_S and cut_s < BOUND_S, (answered_s, cut_s)
        # the route header's reason of a retried request ends "; retry"
        routes = [route(a) for a in answers]
        assert all(r["engine"] == steady.url for r in routes), routes
        assert sum(retried(a) for a in answers) == 2, routes
        assert any("stopped answering (frozen)" in line for line in rest), rest[-3:]
        assert (
            metric_value(router.url, "kvatlas_router_retries_total", engine=frozen, cause="frozen")
            == 2
        )
        assert (
            metric_value(
                router.url, "kvatlas_router_stream_failures_total", engine=frozen, cause="frozen"
            )
            == 1
        )
        out = _engine(router, frozen)
        assert not out.available and "no answer" in out.last_error
        assert out.in_flight == 0 and out.queued_prefill_tokens == 0
    finally:
        os.kill(frozen_one.pid, signal.SIGCONT)
    # resumed: the probe takes it back, and it serves the next requests
    wait_until(lambda: frozen in available(router), what="the resumed engine back", timeout=60)
    engines = {route(_post(router, chat(f"after {i}")))["engine"] for i in range(4)}
    assert engines == {frozen, steady.url}
    # a relay's accounting ends just after its client has the last byte
    wait_until(
        lambda: [(e.in_flight, e.queued_prefill_tokens) for e in router.status().engines],
        lambda loads: loads == [(0, 0), (0, 0)],
        what="the router's load accounting back to zero",
        timeout=10,
    )
    # what it finished for clients that had gone elsewhere broke nothing
    assert _post(router, chat("and once more")).json()["choices"]


def test_a_stream_whose_engine_freezes_before_its_first_event_is_retried(
    frozen_one: Proc, steady: EngineApp, start_router: StartRouter
) -> None:
    """Nothing of it reached the client: it goes to the next choice, and the client sees
    a whole stream from there (the route header says ``; retry``), not an error. (The
    reference engine sends a stream's head with its first event, once its worker has
    tokenized the request; a head sent before the first event is the next test's.)"""
    router = _router(start_router, frozen_one, steady)  # the next request goes to it
    frozen = frozen_one.url
    # a long answer it works on, and the stream queued behind it (round-robin: one to
    # the other engine between them): the stream has neither its head nor its first event
    blocker = {
        "prompt": LONG_PROMPT, "max_tokens": BLOCKER_TOKENS, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    body = chat("a story", max_tokens=8, stream=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(_post, router, blocker, "completions")
            wait_until(lambda: _engine(router, frozen).in_flight, what="the blocker is sent")
            assert route(_post(router, chat("turn")))["engine"] == steady.url
            streamed = pool.submit(_stream, router, body)
            # sent, or on its way: the engine tokenizes it on its worker, behind the
            # blocker, and frozen answers nothing of it either way (nor does the kernel
            # that holds a request it has not read)
            wait_until(
                lambda: router.service.wires.armed(frozen, "first_byte"),
                lambda n: n == 2,
                what="the stream queued behind it",
            )
            os.kill(frozen_one.pid, signal.SIGSTOP)
            headers, lines = streamed.result()
            blocked = first.result()
    finally:
        os.kill(frozen_one.pid, signal.SIGCONT)
    for h in (headers, blocked.headers):
        assert route(h)["engine"] == steady.url and retried(h), route(h)
    assert lines[-1] == "data: [DONE]" and not any("error" in line for line in lines), lines
    assert (
        metric_value(router.url, "kvatlas_router_retries_total", engine=frozen, cause="frozen") == 2
    )
    assert metric_value(router.url, "kvatlas_router_stream_failures_total", engine=frozen) == 0
    wait_until(lambda: frozen in available(router), what="the resumed engine back", timeout=60)


class _CuttingEngine:
    """A fake engine on 127.0.0.1: ``/metrics`` answers 200; a stream's request gets an
    event stream's head and a closed connection, before any event; a request whose body
    says ``"whole"`` gets a 1000-byte answer, one that says ``"cut"`` the same answer's
    first 600 bytes and a closed connection; any other request gets a head that promises
    1000 bytes, 20 of them, and a closed connection. Every answer says ``connection:
    close``, as it closes each connection after one answer: a client that reused one
    would see a failure this engine did not mean to send."""

    def __init__(self) -> None:
        self._sock = socket.create_server((HOST, 0))
        self.url = f"http://{HOST}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        break
                    data += more
                head, _, body = data.partition(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                while length and len(body) < int(length.group(1)):
                    more = conn.recv(65536)
                    if not more:
                        break
                    body += more
                if head.split(b" ")[1:2] == [b"/metrics"]:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
                    )
                elif b'"whole"' in body or b'"cut"' in body:
                    answer = b'{"choices": [{"text": "' + b"x" * 973 + b'"}]}'
                    assert len(answer) == 1000
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nconnection: close\r\n"
                        b"content-type: application/json\r\n"
                        b"content-length: 1000\r\n\r\n"
                        + (answer if b'"whole"' in body else answer[:600])
                    )
                elif b'"stream":true' in body.replace(b" ", b""):
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nconnection: close\r\n"
                        b"content-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n"
                    )
                else:
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nconnection: close\r\n"
                        b"content-type: application/json\r\n"
                        b'content-length: 1000\r\n\r\n{"choices": [{"text": '
                    )

    def close(self) -> None:
        self._sock.close()


def test_an_answer_cut_short_is_retried_with_one_clear_line(
    steady: EngineApp, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-streamed answer is relayed once it is whole, a stream once its first event
    is in: one its engine cuts short before then reached nobody, so it goes to the next
    choice, and the router says so in one line (request id, engine, cause), with no
    traceback from the HTTP server."""
    cutter = _CuttingEngine()
    asgi = logging.getLogger("uvicorn.error")  # it does not propagate to the root
    asgi.addHandler(caplog.handler)
    try:
        router = start_router(
            engines=(StaticEngine(cutter.url, "c"), StaticEngine(steady.url, "y")),
            policy="round-robin",
            breaker_failures=100,
        )
        wait_until(lambda: len(available(router)), lambda n: n == 2, what="both engines")
        with caplog.at_level(logging.WARNING):
            answers = [
                _post(router, chat(f"question {i}"), headers={"x-request-id": f"cut-{i}"})
                for i in range(4)
            ]
            streams = [_stream(router, chat(f"story {i}", stream=True)) for i in range(2)]
    finally:
        asgi.removeHandler(caplog.handler)
        cutter.close()
    routes = [route(a) for a in answers]
    assert all(r["engine"] == steady.url for r in routes), routes
    assert all(a.json()["choices"] for a in answers)
    rids = [a.headers["x-request-id"] for a in answers if retried(a)]
    assert len(rids) == 2, routes
    for rid in rids:
        lines = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
        assert len(lines) == 1, lines
        assert cutter.url in lines[0] and "(broken: " in lines[0], lines[0]
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()]
    # round-robin: one of the two streams was sent to the cutter first
    assert sum(retried(h) for h, _ in streams) == 1, [route(h) for h, _ in streams]
    for h, lines in streams:
        assert route(h)["engine"] == steady.url, route(h)
        assert lines[-1] == "data: [DONE]" and not any("error" in x for x in lines), lines
    assert (
        metric_value(router.url, "kvatlas_router_retries_total", engine=cutter.url, cause="broken")
        == 3
    )
    assert metric_value(router.url, "kvatlas_router_stream_failures_total", engine=cutter.url) == 0


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A coordinator in a process of its own, to freeze; resumed before it is stopped."""
    log = tmp_path_factory.mktemp("failover-coordinator") / "coordinator.log"
    proc = start_coordinator_process(log=log)
    try:
        yield proc
    finally:
        if proc.alive():
            os.kill(proc.pid, signal.SIGCONT)
        proc.stop()


LOOKUP_S = 2.0
"""The router's ``--lookup-timeout`` in the coordinator test: long enough that a request
that waited for it cannot pass for one that did not."""


def _overhead_s(resp: httpx.Response) -> float:
    """The router's own time for a request (tokenize + lookup + pick), from its header."""
    return float(route(resp)["overhead_ms"]) / 1000


def test_a_frozen_coordinator_routes_by_load_without_waiting_and_comes_back(
    coordinator: Proc, steady: EngineApp, start_router: StartRouter
) -> None:
    """Frozen (its sockets accept, nothing answers): the lookups in flight end at the
    first one's timeout, every request is answered by load, and the requests after that
    do not wait on the coordinator (its trials run in the background every backoff);
    resumed, routing by the directory comes back."""
    router = start_router(
        coordinator_urls=(coordinator.url,),
        engines=(StaticEngine(steady.url, "y"),),
        model_name="tiny-random",
        policy="kv",
        lookup_timeout_s=LOOKUP_S,
        coordinator_backoff_s=0.2,
        refresh_interval_s=0.2,
    )
    wait_until(lambda: len(available(router)), lambda n: n == 1, what="the engine")
    wires = router.service.wires

    def ask(i: int) -> httpx.Response:
        body = {"prompt": [7 + i % 50] * 40, "max_tokens": 1, "temperature": 0}
        return _post(router, body, "completions")

    assert route(ask(0))["reason"] == "kv: load"  # the coordinator answers: no holder
    assert metric_value(router.url, "kvatlas_router_coordinator_available") == 1
    os.kill(coordinator.pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(ask, 1)
            wait_until(lambda: wires.armed(COORDINATOR, "lookup"), what="a lookup waits")
            # not synchronisation: the second lookup is to start half a timeout after
            # the first, so that it is ended with the first, not after a timeout of its own
            time.sleep(LOOKUP_S / 2)
            second = pool.submit(ask, 2)
            wait_until(
                lambda: wires.armed(COORDINATOR, "lookup"), lambda n: n == 2,
                what="a second lookup waits",
            )  # fmt: skip
            a, b = first.result(), second.result()
        assert [route(r)["reason"] for r in (a, b)] == ["least-loaded: lookup unavailable"] * 2
        # the first waited its whole timeout; the second, half of one, was ended with it
        assert _overhead_s(a) >= LOOKUP_S * 0.9, route(a)
        assert _overhead_s(b) < LOOKUP_S * 0.75, route(b)
        assert metric_value(router.url, "kvatlas_router_coordinator_available") == 0
        # out: for ten backoffs' time, no request waits on it (the trials are not theirs)
        since = time.monotonic()
        later: list[httpx.Response] = []
        while time.monotonic() - since < 10 * 0.2 or len(later) < 5:
            later.append(ask(3 + len(later)))
        assert all(route(r)["reason"] == "least-loaded: lookup unavailable" for r in later), [
            route(r) for r in later
        ]
        assert max(_overhead_s(r) for r in later) < LOOKUP_S / 2, [route(r) for r in later]
    finally:
        os.kill(coordinator.pid, signal.SIGCONT)
    wait_until(
        lambda: route(ask(99))["reason"],
        lambda reason: reason == "kv: load",
        what="routing by the directory again",
        timeout=30,
    )
    assert metric_value(router.url, "kvatlas_router_coordinator_available") == 1


def test_an_answer_past_the_held_size_is_relayed_as_it_comes(
    steady: EngineApp, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    """The router holds at most ``--max-held-answer-mb`` of a non-streamed answer: a
    longer one goes to the client as it comes, whole when its engine sends it whole;
    one cut short after that reaches the client cut (its connection closes before the
    promised length: a client error, never a short body taken for whole), with one
    line in the log and no traceback, and the router serves the next request."""
    cutter = _CuttingEngine()
    asgi = logging.getLogger("uvicorn.error")
    asgi.addHandler(caplog.handler)
    try:
        router = start_router(
            engines=(StaticEngine(cutter.url, "c"),),
            breaker_failures=100,
            max_held_answer_bytes=100,
        )
        wait_until(lambda: len(available(router)), lambda n: n == 1, what="the engine")
        with caplog.at_level(logging.WARNING):
            whole = _post(router, {"model": "m", "prompt": "whole"}, "completions")
            with pytest.raises(httpx.RemoteProtocolError):
                httpx.post(
                    f"{router.url}/v1/completions",
                    json={"model": "m", "prompt": "cut"},
                    headers={"x-request-id": "cut-late"},
                    timeout=30,
                )
            again = _post(router, {"model": "m", "prompt": "whole"}, "completions")
    finally:
        asgi.removeHandler(caplog.handler)
        cutter.close()
    for r in (whole, again):
        assert len(r.content) == 1000 and r.json()["choices"][0]["text"] == "x" * 973
        assert not retried(r)
    lines = [r.getMessage() for r in caplog.records if "cut-late" in r.getMessage()]
    assert len(lines) == 1 and "closes before the answer's length" in lines[0], lines
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()]
    assert metric_value(router.url, "kvatlas_router_stream_failures_total", engine=cutter.url) == 1
    assert metric_value(router.url, "kvatlas_router_retries_total", engine=cutter.url) == 0
