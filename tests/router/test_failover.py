"""An engine that freezes (SIGSTOP: its sockets stay open, nothing answers) costs no
request, and one that is only busy is not failed over.

A real reference engine runs as a process of its own (it is frozen and resumed with
signals); the other is in this process. The router probes every 0.2 s with a 1 s probe
timeout, and keeps its default 600 s ``--engine-timeout``: every bound below is the
probe's, not the timeout's.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvatlas.engine.engine_app import EngineApp
from kvatlas.engine.model import LoadedModel
from kvatlas.router.app import RouterApp
from kvatlas.router.config import StaticEngine
from kvatlas.router.service import ROUTE_HEADER
from kvatlas.runtime.procs import free_port
from support.launch import Proc, launch, python_module
from support.wait import wait_until

from .conftest import StartRouter, engine_config
from .test_router import available, chat, route

HEALTH_S = 0.2
PROBE_TIMEOUT_S = 1.0
BOUND_S = 30.0
"""Freeze to answer, generously (a loaded 2-core machine): far below the 600 s timeout."""
LONG_PROMPT = [5 + i % 200 for i in range(1800)]
"""A prompt the reference engine takes seconds to prefill on a CPU."""


@pytest.fixture(scope="module")
def frozen_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A reference engine in a process of its own, to freeze; always resumed at the end."""
    port = free_port()
    argv = python_module(
        "kvatlas.cli.engine", "--model", "tiny-random", "--port", str(port), "--no-cache",
        "--max-model-len", "2048", "--num-threads", "1",
    )  # fmt: skip
    log = tmp_path_factory.mktemp("failover") / "frozen.log"
    # a generous start: torch's import alone takes a minute on a loaded 2-core machine
    with launch(argv, name="frozen", log=log, http_port=port, timeout=300) as p:
        try:
            yield p
        finally:
            os.kill(p.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def steady(tiny: LoadedModel) -> Iterator[EngineApp]:
    app = EngineApp(engine_config(), model=tiny)
    app.start()
    try:
        yield app
    finally:
        app.stop()


def _router(start_router: StartRouter, frozen: Proc, steady: EngineApp) -> RouterApp:
    router = start_router(
        engines=(StaticEngine(frozen.url, "x"), StaticEngine(steady.url, "y")),
        policy="round-robin",
        health_interval_s=HEALTH_S,
        probe_timeout_s=PROBE_TIMEOUT_S,
    )
    wait_until(lambda: len(available(router)), lambda n: n == 2, what="both engines", timeout=60)
    # round-robin: after an answer from the steady engine, the next request goes to the other
    while route(_post(router, chat("warm up")))["engine"] != steady.url:
        pass
    return router


def _post(router: RouterApp, body: dict[str, Any], path: str = "chat/completions") -> Any:
    r = httpx.post(f"{router.url}/v1/{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _metric(router: RouterApp, name: str, **labels: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    total = 0.0
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _engine(router: RouterApp, url: str) -> Any:
    return next(e for e in router.status().engines if e.url == url)


def test_a_busy_engine_is_not_failed_over(
    frozen_one: Proc, steady: EngineApp, start_router: StartRouter
) -> None:
    """A long prefill, a request queued behind it and a slow stream on one engine: its
    probe answers while it works, so all three are its own to the end."""
    router = _router(start_router, frozen_one, steady)
    busy = frozen_one.url
    long = {"prompt": LONG_PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    seen: list[tuple[bool, int]] = []
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(_post, router, long, "completions")
        wait_until(lambda: _engine(router, busy).in_flight, what="the long prefill is sent")
        pool.submit(_post, router, chat("keep me busy")).result()  # the steady engine's turn
        queued = pool.submit(_post, router, chat("queued behind it", max_tokens=8))
        wait_until(lambda: _engine(router, busy).in_flight == 2, what="one queued behind it")
        while not (first.done() and queued.done()):
            e = _engine(router, busy)
            seen.append((e.available, e.reported_running))
            time.sleep(HEALTH_S / 2)
        answers = [first.result(), queued.result()]
    assert [route(a)["engine"] for a in answers] == [busy, busy]
    assert all("; retry;" not in a.headers[ROUTE_HEADER] for a in answers)
    assert all(ok for ok, _ in seen), "the busy engine was taken out"
    assert any(running >= 1 for _, running in seen), "no probe answered while it worked"
    # a stream that is slow, not stuck, runs to its end
    body = chat("a slow story", max_tokens=24, stream=True)
    while route(_post(router, chat("turn"))).get("engine") != steady.url:
        pass
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=120) as s:
        assert route(s)["engine"] == busy
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and not any("error" in line for line in lines)
    assert _metric(router, "kvatlas_router_retries_total", engine=busy) == 0
    assert _metric(router, "kvatlas_router_stream_failures_total", engine=busy) == 0


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
        headers = [a.headers[ROUTE_HEADER] for a in answers]
        assert all(h.startswith(f"engine={steady.url};") for h in headers), headers
        assert sum("; retry;" in h for h in headers) == 2, headers
        assert any("stopped answering (frozen)" in line for line in rest), rest[-3:]
        assert _metric(router, "kvatlas_router_retries_total", engine=frozen, cause="frozen") == 2
        assert (
            _metric(router, "kvatlas_router_stream_failures_total", engine=frozen, cause="frozen")
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
