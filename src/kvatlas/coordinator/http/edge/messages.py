"""The HTTP edge's messages: a request as handlers get it, a response as they give it,
and the bytes of an answer's head.

Owns `HttpRequest`, `HttpResponse`, the ``{"error": reason}`` body every kvatlas service
answers errors with, and the encoding of a response's head (status line, content type
and length, extra header lines, ``connection: close``). Must not parse, route or do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qsl

import msgspec


@dataclass(slots=True)
class HttpRequest:
    """One complete request. Header names are lower-case; the body is whole: a
    ``bytearray`` when it was read straight into its own buffer (``DIRECT_BODY_BYTES``),
    which nothing changes once the request is handed over."""

    method: str
    path: str
    query_string: str
    headers: dict[str, str]
    body: bytes | bytearray
    path_params: dict[str, str] = field(default_factory=dict)
    arrived: float = 0.0
    """The server's clock (``time.monotonic()`` unless a test injects another) when the
    data holding the request's first byte arrived: a handler reports the time before it
    from it (reading, parsing, waiting in line)."""

    @property
    def query(self) -> dict[str, str]:
        """Query parameters; the last one wins when a name repeats."""
        return dict(parse_qsl(self.query_string, keep_blank_values=True))


@dataclass(slots=True, frozen=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def encode_head(status: int, content_type: str, length: int, extra: bytes, close: bool) -> bytes:
    """An answer's head; ``extra`` is header lines, each ending in CRLF."""
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s%s\r\n" % (
        status,
        _REASONS.get(status, b"Unknown"),
        content_type.encode(),
        length,
        extra,
        b"connection: close\r\n" if close else b"",
    )


def response_head(response: HttpResponse, close: bool) -> bytes:
    """The head of ``response``, its own header lines included."""
    extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in response.headers)
    return encode_head(response.status, response.content_type, len(response.body), extra, close)


def error_body(reason: str) -> bytes:
    """``{"error": reason}``, the shape of every kvatlas service's error answer."""
    return msgspec.json.encode({"error": reason})


def closing_answer(status: int, reason: str, extra: bytes) -> bytes:
    """A whole error answer that closes the connection."""
    body = error_body(reason)
    return encode_head(status, "application/json", len(body), extra, True) + body
