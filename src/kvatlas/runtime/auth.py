"""The fleet's shared-token gate, one for every place that checks the token.

Owns ``TokenGate``: the comparison of what a request offers with the shared token
(``--auth-token`` / ``KVATLAS_AUTH_TOKEN``), in constant time over bytes, either as a raw
token (the engine API, the P2P control channel, the tcp transport) or as an
``Authorization: Bearer <token>`` header (the coordinator's and the cache server's HTTP).
It answers True or False to any input and never raises: a token that is not ASCII,
bytes that are not UTF-8, a missing value or one of the wrong type is simply not the
token (``hmac.compare_digest`` raises TypeError on a ``str`` that is not ASCII, which is
why nothing compares ``str`` here). Must not log, echo or store what it was offered, nor
know any service's paths or answers.
"""

from __future__ import annotations

import hmac

_BEARER = b"Bearer "


class TokenGate:
    """``TokenGate(None)`` or ``TokenGate("")`` lets everything through."""

    __slots__ = ("_header", "_token")

    def __init__(self, token: str | None) -> None:
        self._token = _utf8(token) if token else b""
        self._header = _BEARER + self._token

    @property
    def required(self) -> bool:
        """A token is set: requests must offer it."""
        return bool(self._token)

    def check(self, token: object) -> bool:
        """A raw token (``str`` or bytes-like): True when it is the token or none is set."""
        if not self._token:
            return True
        if isinstance(token, str):
            offered = _utf8(token)
        elif isinstance(token, bytes | bytearray | memoryview):
            offered = bytes(token)
        else:
            return False
        return hmac.compare_digest(offered, self._token)

    def check_header(self, value: object) -> bool:
        """An ``Authorization`` header value: True when it is ``Bearer <token>`` or no
        token is set. A ``str`` is taken as HTTP servers decode header bytes (latin-1),
        so that the bytes compared are the bytes the client sent."""
        if not self._token:
            return True
        if isinstance(value, str):
            try:
                offered = value.encode("latin-1")
            except UnicodeEncodeError:  # not from the wire; compare it as text
                offered = _utf8(value)
        elif isinstance(value, bytes | bytearray | memoryview):
            offered = bytes(value)
        else:
            return False
        return hmac.compare_digest(offered, self._header)


def _utf8(text: str) -> bytes:
    # surrogatepass: a str holding lone surrogates still has bytes to compare.
    return text.encode("utf-8", "surrogatepass")
