"""The router's gate: with ``--auth-token`` set, its clients must bear the fleet's token.

Owns which paths stay open (``/healthz`` and ``/readyz``: a load balancer's probe carries
no secret, and they answer none), the two headers that may carry the token, and the 401
answer. The token is taken either way a client can send it without losing its own
``Authorization``, which passes to the engines byte for byte in both cases:

- ``Authorization: Bearer <token>``, as every kvatlas service takes it; the router checks
  it and forwards the header unchanged (engines that check an API key, say vLLM's
  ``--api-key``, are then given the same token);
- ``Proxy-Authorization: Bearer <token>``, the header HTTP defines for authenticating to
  an intermediary: hop-by-hop, consumed here and never forwarded, so a client whose
  ``Authorization`` carries the engines' own key still passes.

The comparison is the fleet's one ``TokenGate`` (constant time over the header's bytes).
Refusals are counted by reason (``missing``, ``wrong``). Must not: log, echo or store what
a client offered, or touch a request it admits (the service forwards it as it came).
"""

from __future__ import annotations

import logging
from typing import Final

import msgspec
from prometheus_client import Counter
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvatlas.runtime.auth import TokenGate

log = logging.getLogger(__name__)

OPEN_PATHS: Final = frozenset({"/healthz", "/readyz"})
_AUTHORIZATION: Final = b"authorization"
_PROXY_AUTHORIZATION: Final = b"proxy-authorization"
_HOW: Final = (
    "send Authorization: Bearer <token>, or Proxy-Authorization: Bearer <token> when"
    " Authorization carries the engines' own key"
)
_MESSAGES: Final = {
    "missing": f"this router requires the fleet's token (its --auth-token): {_HOW}",
    "wrong": f"wrong token: this router requires the fleet's token (its --auth-token): {_HOW}",
}


class RouterGate:
    """ASGI middleware: every HTTP request outside ``OPEN_PATHS`` must bear the token
    in ``Authorization`` or ``Proxy-Authorization``; without a token, all pass."""

    def __init__(self, app: ASGIApp, token: str | None, refusals: Counter) -> None:
        self._app = app
        self._gate = TokenGate(token)
        self._refusals = refusals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._gate.required or scope["path"] in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        offered = [v for k, v in scope["headers"] if k in (_AUTHORIZATION, _PROXY_AUTHORIZATION)]
        # every offered header is compared, so the time taken does not say which one held it
        admitted = [self._gate.check_header(v) for v in offered]
        if any(admitted):
            await self._app(scope, receive, send)
            return
        reason = "wrong" if offered else "missing"
        self._refusals.labels(reason).inc()
        client = scope.get("client")
        log.debug(
            "router: refused %s %s from %s: %s token",
            scope["method"], scope["path"], client[0] if client else "?", reason,
        )  # fmt: skip
        body = msgspec.json.encode(
            {
                "error": {
                    "message": _MESSAGES[reason],
                    "type": "authentication_error",
                    "code": f"{reason}_token",
                }
            }
        )
        refused = Response(
            body,
            status_code=401,
            media_type="application/json",
            headers={"www-authenticate": 'Bearer realm="kvatlas router"'},
        )
        await refused(scope, receive, send)
