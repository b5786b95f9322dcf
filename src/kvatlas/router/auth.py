"""The router's gate: who a request is (the fleet, the operator, a tenant), and the 401s.

Owns which paths stay open (``/healthz`` and ``/readyz``: a load balancer's probe carries
no secret, and they answer none), the two headers that may carry a credential, the 401
and 403 answers, and the ``Caller`` it leaves in the request's scope (``CALLER_KEY``) for
the service:

- the operator's token (``--operator-token-file``) admits to every path; only its
  requests are told how they were routed (``relay``);
- without ``--tenants``, the fleet's token (``--auth-token``) admits to every path, and
  with no token set all pass. The token is taken either way a client can send it without
  losing its own ``Authorization``, which passes to the engines byte for byte:
  ``Authorization: Bearer <token>``, as every kvatlas service takes it, or
  ``Proxy-Authorization: Bearer <token>``, the header HTTP defines for authenticating to
  an intermediary (hop-by-hop, consumed here and never forwarded);
- with ``--tenants``, the OpenAI paths take a tenant's API key (``Authorization: Bearer
  <key>``): an unknown or missing key gets 401. The tenant's key never reaches an engine
  (the service sends the fleet's token instead). The other paths (``/metrics``,
  ``/status``: the fleet's figures) need the fleet's or the operator's token, so no
  tenant reads them (403 for a tenant's key). The fleet's token on an OpenAI path is a
  request of no tenant: its own ``cache_salt`` stands, as without tenants.

Tokens are compared by the fleet's one ``TokenGate`` (constant time over the header's
bytes), keys by their SHA-256 digest (``core.tenancy``); every offered header is checked
against every credential, so the time taken does not say which one held it. Refusals
are counted by reason (``missing``, ``wrong``, ``unknown_key``, ``not_operator``). Must
not: log, echo or store what a client offered, or touch a request's body.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final, Literal

import msgspec
from prometheus_client import Counter
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvatlas.core.tenancy import Tenant
from kvatlas.router.tenants import TenantsFile
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
    "missing_key": "this router requires an API key: send 'Authorization: Bearer <API key>'",
    "wrong": f"wrong token: this router requires the fleet's token (its --auth-token): {_HOW}",
    "unknown_key": "unknown API key: send 'Authorization: Bearer <your API key>'",
    "not_operator": "this path needs the fleet's or the operator's token, not an API key",
}


CallerKind = Literal["anyone", "fleet", "operator", "tenant"]
CALLER_KEY: Final = "kvatlas.caller"
"""Where the gate leaves the request's ``Caller`` in its ASGI scope."""
TENANT_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is: ``anyone`` (no credential is configured), ``fleet`` (the fleet's
    token), ``operator`` (the operator's token) or ``tenant`` (a tenant's API key)."""

    kind: CallerKind
    tenant: Tenant | None = None

    @property
    def is_operator(self) -> bool:
        return self.kind == "operator"


ANYONE: Final = Caller("anyone")
_FLEET: Final = Caller("fleet")
_OPERATOR: Final = Caller("operator")


def caller_of(scope: Scope) -> Caller:
    """The caller the gate admitted (``anyone`` where no gate ran)."""
    caller = scope.get(CALLER_KEY)
    return caller if isinstance(caller, Caller) else ANYONE


def _bearer(value: bytes) -> str | None:
    scheme, _, rest = value.partition(b" ")
    if scheme.lower() != b"bearer" or not rest.strip():
        return None
    try:
        return rest.strip().decode()
    except UnicodeDecodeError:
        return None


class RouterGate:
    """ASGI middleware: admits a request outside ``OPEN_PATHS`` by its credential and
    leaves its ``Caller`` in the scope (see the module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        refusals: Counter,
        *,
        operator_token: str = "",
        tenants: TenantsFile | None = None,
    ) -> None:
        self._app = app
        self._gate = TokenGate(token)
        self._operator = TokenGate(operator_token or None)
        self._tenants = tenants
        self._refusals = refusals

    def _admit(self, path: str, offered: list[bytes]) -> Caller | str:
        """The caller, or the reason it is refused."""
        operator = [self._operator.check_header(v) for v in offered]
        fleet = [self._gate.check_header(v) for v in offered]
        if self._operator.required and any(operator):
            return _OPERATOR
        if self._tenants is not None:
            if path in TENANT_PATHS:
                table = self._tenants.table
                keys = [_bearer(v) for v in offered]
                tenants = [table.by_key(k) for k in keys if k is not None]
                tenant = next((t for t in tenants if t is not None), None)
                if tenant is not None:
                    return Caller("tenant", tenant)
                if self._gate.required and any(fleet):
                    return _FLEET
                return "unknown_key" if offered else "missing"
            if self._gate.required and any(fleet):
                return _FLEET
            return "not_operator" if offered else "missing"
        if not self._gate.required:
            return ANYONE
        if any(fleet):
            return _FLEET
        return "wrong" if offered else "missing"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        if not (self._gate.required or self._operator.required or self._tenants):
            await self._app(scope, receive, send)
            return
        offered = [v for k, v in scope["headers"] if k in (_AUTHORIZATION, _PROXY_AUTHORIZATION)]
        got = self._admit(scope["path"], offered)
        if isinstance(got, Caller):
            scope[CALLER_KEY] = got
            await self._app(scope, receive, send)
            return
        reason = got
        self._refusals.labels(reason).inc()
        client = scope.get("client")
        log.debug(
            "router: refused %s %s from %s: %s",
            scope["method"], scope["path"], client[0] if client else "?", reason,
        )  # fmt: skip
        status = 403 if reason == "not_operator" else 401
        body = msgspec.json.encode(
            {
                "error": {
                    "message": _MESSAGES[
                        "missing_key" if reason == "missing" and self._tenants else reason
                    ],
                    "type": "authentication_error",
                    "code": reason if reason.endswith("key") else f"{reason}_token",
                }
            }
        )
        headers = {"www-authenticate": 'Bearer realm="kvatlas router"'} if status == 401 else {}
        refused = Response(body, status_code=status, media_type="application/json", headers=headers)
        await refused(scope, receive, send)
