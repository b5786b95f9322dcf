"""The server's HTTP endpoints (/status, /metrics, /healthz) and their uvicorn thread.

Owns the starlette app and ``UvicornThread``, which serves it; ``--http-port`` is bound
at construction (a taken port raises PortInUse before anything runs). The documents come
from callables the composition root passes in; the token check is the fleet's one
``TokenGate``. Must not: reach into the chunk store or take its lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvatlas.runtime.auth import TokenGate
from kvatlas.runtime.net import bind
from kvatlas.server.errors import ServerError
from kvatlas.server.metrics import CONTENT_TYPE
from kvatlas.wire.server_status import ServerStatus

log = logging.getLogger(__name__)


def build_app(
    status: Callable[[], ServerStatus],
    metrics: Callable[[], bytes],
    auth_token: str | None = None,
) -> Starlette:
    """/status and /metrics need ``Authorization: Bearer <auth_token>`` when it is set;
    /healthz never does (probes carry no secrets)."""
    gate = TokenGate(auth_token)

    def denied(request: Request) -> Response | None:
        if not gate.check_header(request.headers.get("authorization")):
            return Response(
                b'{"error":"this endpoint requires Authorization: Bearer <auth token>"}',
                status_code=401,
                media_type="application/json",
            )
        return None

    async def get_status(request: Request) -> Response:
        return denied(request) or Response(
            msgspec.json.encode(status()), media_type="application/json"
        )

    async def get_metrics(request: Request) -> Response:
        return denied(request) or Response(metrics(), media_type=CONTENT_TYPE)

    async def healthz(_: Request) -> Response:
        return Response(b'{"ok":true}', media_type="application/json")

    return Starlette(
        routes=[
            Route("/status", get_status, methods=["GET"]),
            Route("/metrics", get_metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )


class UvicornThread:
    """uvicorn serving an ASGI app on a pre-bound socket, in a thread."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        self._sock = bind(host, port, "HTTP", "--http-port")
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._sock]},
            name="kvatlas-http",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServerError(f"HTTP server on port {self.port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        self._sock.close()
