"""The engine API's stop is bounded: a worker stuck in a request does not hang shutdown.

Stopping terminates the ZeroMQ context, which waits for every socket, a stuck worker's
too; the server's SIGTERM once waited there until it was killed. A service whose handle
blocks stands in for any request that does not return.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from kvatlas.launch.procs import HOST
from kvatlas.server.engine_api import EngineApi
from kvatlas.server.engine_service import ServiceIdentity
from kvatlas.wire.engine_proto import (
    PROTOCOL_VERSION,
    ErrorReply,
    GetStats,
    Request,
    RequestBody,
    ResponseBody,
    encode,
)


class StuckService:
    """Answers nothing until released: the request a worker cannot finish."""

    def __init__(self) -> None:
        self.identity = ServiceIdentity("node-stuck", 7, 256, 30.0)
        self.entered = threading.Event()
        self.release = threading.Event()

    def handle(self, body: RequestBody) -> ResponseBody:
        self.entered.set()
        self.release.wait(60)
        return ErrorReply("invalid_input", "released")


def test_stop_returns_while_a_worker_is_stuck_and_says_which(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = StuckService()
    api = EngineApi(service, HOST, 0, workers=1)
    api.start()
    ctx = zmq.Context()
    engine = ctx.socket(zmq.DEALER)
    engine.setsockopt(zmq.LINGER, 0)
    try:
        engine.connect(f"tcp://{HOST}:{api.bound_port}")
        engine.send(encode(Request(PROTOCOL_VERSION, 1, GetStats())))
        assert service.entered.wait(10), "the request never reached the worker"
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="kvatlas.server.engine_api"):
            api.stop()
        # each thread is given 5 s; the stuck worker's socket is left, not waited for
        assert time.monotonic() - t0 < 20
        assert "kvatlas-engine-0 still busy" in caplog.text
        assert "node-stuck incarnation 7" in caplog.text
        assert not api.closed.is_set()
        service.release.set()
        # once the request returns, the sockets are closed after all
        assert api.closed.wait(10)
    finally:
        service.release.set()
        engine.close(0)
        ctx.term()
