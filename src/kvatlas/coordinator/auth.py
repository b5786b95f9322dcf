"""Bearer-token guard of the coordinator API (an ASGI middleware).

Owns the check of `Authorization: Bearer <token>` against the shared token, in
constant time. Every path but `/healthz` is guarded when a token is set. Must not log
the token or the header it was offered.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/healthz"})
_BODY = b'{"error":"missing or wrong bearer token (Authorization: Bearer <token>)"}'


class BearerAuth:
    """Reject guarded requests without the right bearer token with 401."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self._app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        offered = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                offered = value
                break
        if hmac.compare_digest(offered, self._expected):
            await self._app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_BODY)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _BODY})
