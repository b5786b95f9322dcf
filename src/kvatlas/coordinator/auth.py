"""Bearer-token guard of the coordinator API.

Owns the check of `Authorization: Bearer <token>` against the shared token, in
constant time, as the HTTP server's gate: every path but `/healthz` is guarded when a
token is set. Must not log the token or the header it was offered.
"""

from __future__ import annotations

import hmac

from kvatlas.runtime.http_server import HttpRequest, HttpResponse

OPEN_PATHS = frozenset({"/healthz"})
_BODY = b'{"error":"missing or wrong bearer token (Authorization: Bearer <token>)"}'
_REFUSED = HttpResponse(401, _BODY, headers=(("www-authenticate", "Bearer"),))


class BearerAuth:
    """Refuse guarded requests without the right bearer token with 401."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def __call__(self, request: HttpRequest) -> HttpResponse | None:
        if request.path in OPEN_PATHS:
            return None
        offered = request.headers.get("authorization", "").encode("latin-1")
        if hmac.compare_digest(offered, self._expected):
            return None
        return _REFUSED
