"""A bounded load through the router while one of its engines freezes (SIGSTOP of a real
reference engine process: its sockets stay open, nothing answers): no request is lost.
Every request none of whose answer reached its client is answered by the other engine
(the route header says ``; retry``); a stream that had begun on the frozen engine ends
with an error event naming the cause; nothing waits for the 600 s ``--engine-timeout``.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvatlas.engine.engine_app import EngineApp
from kvatlas.engine.model import LoadedModel
from kvatlas.router.app import RouterApp
from kvatlas.router.config import StaticEngine
from support.launch import Proc
from support.wait import wait_until

from .conftest import (
    StartRouter,
    engine_in_process,
    engine_process,
    retried,
    route,
)
from .test_router import available, chat

CLIENTS = 4
PER_CLIENT = 12
"""The load: 4 clients, 12 requests each, one at a time (every third a stream)."""
BOUND_S = 30.0
"""The longest any request may take, generously (a loaded 2-core machine): far below
the 600 s timeout one that waited on the frozen engine to the end would take."""


@pytest.fixture(scope="module")
def frozen_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    with engine_process(tmp_path_factory.mktemp("frozen-load") / "frozen.log") as p:
        yield p


@pytest.fixture(scope="module")
def steady(tiny: LoadedModel) -> Iterator[EngineApp]:
    with engine_in_process(tiny) as app:
        yield app


def _one(router: RouterApp, client: int, i: int) -> dict[str, Any]:
    """One request of the load: what its client got."""
    stream = i % 3 == 2
    body = chat(f"client {client} question {i}", max_tokens=12, stream=stream)
    url = f"{router.url}/v1/chat/completions"
    t0 = time.monotonic()
    if not stream:
        r = httpx.post(url, json=body, timeout=120)
        ok = r.status_code == 200 and bool(r.json().get("choices"))
        return {"stream": False, "ok": ok, "cut": False, "retried": ok and retried(r),
                "engine": route(r)["engine"] if ok else r.text,
                "s": time.monotonic() - t0}  # fmt: skip
    with httpx.stream("POST", url, json=body, timeout=120) as s:
        lines = [line for line in s.iter_lines() if line] if s.status_code == 200 else []
        whole = bool(lines) and lines[-1] == "data: [DONE]"
        cut = bool(lines) and "stopped answering" in lines[-1]
        return {"stream": True, "ok": whole, "cut": cut, "retried": retried(s.headers),
                "engine": route(s.headers)["engine"], "s": time.monotonic() - t0}  # fmt: skip


def test_a_frozen_engine_under_load_loses_no_request(
    frozen_one: Proc, steady: EngineApp, start_router: StartRouter
) -> None:
    router = start_router(
        engines=(StaticEngine(frozen_one.url, "x"), StaticEngine(steady.url, "y")),
        policy="round-robin",
        probe_timeout_s=1.0,
    )
    wait_until(lambda: len(available(router)), lambda n: n == 2, what="both engines", timeout=60)
    frozen = frozen_one.url
    done = threading.Event()
    froze_at: list[float] = []

    def freezer() -> None:
        # once the load runs and the engine has requests in flight: freeze it
        wait_until(
            lambda: next(e.in_flight for e in router.status().engines if e.url == frozen),
            lambda n: n >= 1 or done.is_set(),
            what="work on the engine to freeze",
            timeout=60,
            every=0.01,
        )
        os.kill(frozen_one.pid, signal.SIGSTOP)
        froze_at.append(time.monotonic())

    try:
        with concurrent.futures.ThreadPoolExecutor(CLIENTS + 1) as pool:
            freezing = pool.submit(freezer)
            clients = [
                pool.submit(lambda c: [_one(router, c, i) for i in range(PER_CLIENT)], c)
                for c in range(CLIENTS)
            ]
            results = [r for f in clients for r in f.result()]
            done.set()
            freezing.result()
    finally:
        os.kill(frozen_one.pid, signal.SIGCONT)
    assert froze_at, "the engine was never frozen"
    slowest = max(r["s"] for r in results)
    assert slowest < BOUND_S, slowest
    lost = [r for r in results if not r["ok"] and not r["cut"]]
    assert lost == [], lost
    cut = [r for r in results if r["cut"]]
    assert all(r["stream"] and r["engine"] == frozen for r in cut), cut
    # requests that waited on the frozen engine were answered by the other one
    moved = [r for r in results if r["retried"]]
    assert moved and all(r["engine"] == steady.url for r in moved), moved
    assert len(results) == CLIENTS * PER_CLIENT
    print(
        f"{len(results)} requests, one engine frozen under them: lost 0, retried on the"
        f" other engine {len(moved)}, streams cut with a reason"
        f" {len(cut)}, slowest request {slowest:.1f} s"
    )
    wait_until(lambda: frozen in available(router), what="the resumed engine back", timeout=60)
