"""The server's HTTP endpoints (/status, /metrics, /healthz, and the routes it is given).

Owns the starlette app; ``runtime.asgi_thread.AsgiThread`` serves it (``--http-port`` is
bound at construction: a taken port raises PortInUse before anything runs). The documents come
from callables the composition root passes in; the token check is the fleet's one
``TokenGate``. Must not: reach into the chunk store or take its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvatlas.runtime.auth import TokenGate
from kvatlas.server.metrics import CONTENT_TYPE
from kvatlas.wire.server_status import ServerStatus

log = logging.getLogger(__name__)


def build_app(
    status: Callable[[], ServerStatus],
    metrics: Callable[[], bytes],
    auth_token: str | None = None,
    extra_routes: Sequence[Route] = (),
) -> Starlette:
    """/status and /metrics need ``Authorization: Bearer <auth_token>`` when it is set;
    /healthz never does (probes carry no secrets). ``extra_routes``: served too (the
    cache-control routes of ``server.http_cache``, which check the token themselves)."""
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
            *extra_routes,
        ]
    )
