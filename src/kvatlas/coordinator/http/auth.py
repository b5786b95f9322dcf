"""Bearer-token guard of the coordinator API.

Owns which paths are guarded (every path but `/healthz` and the fleet page's files, which
hold no data: the page asks for the token, when a token is set), which tokens admit (the
shared one, and the operator's when set, which alone passes `OperatorCheck`) and the 401
answer, as the HTTP server's gate; the comparison is the fleet's one `TokenGate`. Also
who sees per-tenant figures (`OperatorCheck.sees_tenants`): with an operator token set,
only a request bearing it; a fleet-token caller gets them summed without salts, or a
403 (docs/deploy.md, "Tenants"). Must not log the token or the header it was offered.
"""

from __future__ import annotations

from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.ui.page import ASSET_PATHS
from kvatlas.runtime.auth import TokenGate

OPEN_PATHS = frozenset({"/healthz"}) | ASSET_PATHS
_BODY = b'{"error":"missing or wrong bearer token (Authorization: Bearer <token>)"}'
_REFUSED = HttpResponse(401, _BODY, headers=(("www-authenticate", "Bearer"),))


class BearerAuth:
    """Refuse guarded requests without the right bearer token with 401: the shared
    token, or the operator's (when one is set, it admits too)."""

    def __init__(self, token: str, operator_token: str = "") -> None:
        self._gate = TokenGate(token) if token else None
        self._operator = OperatorCheck(operator_token)

    def __call__(self, request: HttpRequest) -> HttpResponse | None:
        if request.path in OPEN_PATHS:
            return None
        header = request.headers.get("authorization")
        if self._gate is None or self._gate.check_header(header) or self._operator(request):
            return None
        return _REFUSED


class OperatorCheck:
    """Does a request bear the operator token? Always False without one."""

    def __init__(self, operator_token: str) -> None:
        self._gate = TokenGate(operator_token) if operator_token else None

    @property
    def enabled(self) -> bool:
        return self._gate is not None

    def __call__(self, request: HttpRequest) -> bool:
        return self._gate is not None and self._gate.check_header(
            request.headers.get("authorization")
        )

    def sees_tenants(self, request: HttpRequest) -> bool:
        """May the request see figures per ``cache_salt`` (a tenant's identity)? Always
        without an operator token (LMCache's coordinator has none and shows them to
        every caller); with one, only a request bearing it."""
        return self._gate is None or self(request)
