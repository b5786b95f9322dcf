"""Bearer-token guard of the coordinator API.

Owns which paths are guarded (every path but `/healthz` and the fleet page's files, which
hold no data: the page asks for the token, when a token is set) and the 401 answer, as
the HTTP server's gate; the comparison is the fleet's one `TokenGate`. Must not log the
token or the header it was offered.
"""

from __future__ import annotations

from kvatlas.coordinator.fleet_page import ASSET_PATHS
from kvatlas.runtime.auth import TokenGate
from kvatlas.runtime.http_server import HttpRequest, HttpResponse

OPEN_PATHS = frozenset({"/healthz"}) | ASSET_PATHS
_BODY = b'{"error":"missing or wrong bearer token (Authorization: Bearer <token>)"}'
_REFUSED = HttpResponse(401, _BODY, headers=(("www-authenticate", "Bearer"),))


class BearerAuth:
    """Refuse guarded requests without the right bearer token with 401."""

    def __init__(self, token: str) -> None:
        self._gate = TokenGate(token)

    def __call__(self, request: HttpRequest) -> HttpResponse | None:
        if request.path in OPEN_PATHS or self._gate.check_header(
            request.headers.get("authorization")
        ):
            return None
        return _REFUSED
