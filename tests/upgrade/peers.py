"""In-process peers for the version tests: a P2P owner's channel and an engine API over a
stand-in service, either answering as today's code does or as the first release did
(an ``answer`` from `v1_behaviour`), and one raw request over a DEALER."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from kvatlas.launch.procs import HOST
from kvatlas.server.engine_api import EngineApi
from kvatlas.server.engine_service import ServiceIdentity
from kvatlas.server.p2p.channel import ChannelServer, Handler
from kvatlas.wire.engine_proto import RequestBody, StatsResult


class FakeService:
    """Answers every engine request with ``reply``; remembers what it was asked."""

    def __init__(self, reply: Any = None) -> None:
        self.identity = ServiceIdentity("node-x", 7, 256, 30.0)
        self.reply = reply if reply is not None else StatsResult({"served": 1})
        self.asked: list[RequestBody] = []

    def handle(self, body: RequestBody) -> Any:
        self.asked.append(body)
        return self.reply


@contextlib.contextmanager
def channel_server(
    handler: Callable[[Any], Any], answer: Callable[..., Any] | None = None
) -> Iterator[ChannelServer]:
    cls = (
        ChannelServer
        if answer is None
        else type("V1Channel", (ChannelServer,), {"_answer": answer})
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    server = cls(ctx, HOST, 0)
    server.start(handler)
    try:
        yield server
    finally:
        server.stop()
        ctx.term()


@contextlib.contextmanager
def engine_api(
    service: FakeService, answer: Callable[..., Any] | None = None
) -> Iterator[EngineApi]:
    cls = EngineApi if answer is None else type("V1EngineApi", (EngineApi,), {"_answer": answer})
    api = cls(service, HOST, 0, workers=1)
    api.start()
    try:
        yield api
    finally:
        api.stop()


def ask(url: str, payload: bytes, timeout_s: float = 5.0) -> bytes:
    """One request's answer; AssertionError when none comes in time (a hang)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        sock.send_multipart([b"", payload])
        assert sock.poll(int(timeout_s * 1000)), f"{url} did not answer"
        return sock.recv_multipart()[-1]
    finally:
        sock.close(0)
        ctx.term()


__all__ = ["FakeService", "Handler", "ask", "channel_server", "engine_api"]
