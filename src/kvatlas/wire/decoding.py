"""What every decoder of the wire shares: how a message nested too deep is refused, and
the codec of a msgpack request/response protocol.

msgspec raises ``RecursionError`` on a message nested past its recursion limit (say 100k
``[``); every decoder here turns that into a malformed message with the reason
``TOO_DEEP``, never a server error. ``RpcCodec`` is the codec the engine API
(`wire.engine_proto`) and the P2P channel (`wire.p2p_proto`) both use: a request type, a
response type, and an envelope (the header alone) to answer a request that does not
decode; its `RequestHead` also names the operation of such a request, so that a server
tells an operation it does not know (a newer peer's) from a malformed request. Owns
decoding rules only; no I/O and no state.
"""

from __future__ import annotations

from typing import Any, Final, Generic, TypeVar, get_args

import msgspec

from kvatlas.core.errors import HttpRefusal

TOO_DEEP: Final = "nested deeper than the decoder's recursion limit"
"""The reason given for a message whose nesting overflows msgspec's recursion: a
malformed message like any other, not a server error."""


_D = TypeVar("_D")


def decode_or_refuse(
    decoder: msgspec.json.Decoder[_D] | msgspec.msgpack.Decoder[_D],
    body: bytes | bytearray | memoryview,
    refusal: type[HttpRefusal] = HttpRefusal,
    *,
    malformed: int = 400,
    invalid: int = 422,
) -> _D:
    """``decoder.decode(body)``, or ``refusal`` with status ``malformed`` for a body that
    does not parse (nested too deep included) and ``invalid`` for one of the wrong shape.
    The reason starts with "invalid body" for the wrong shape, and "malformed body" for
    a 400 that does not parse ("invalid body" where that is a 422 too, as in LMCache's
    routes): the words every HTTP surface of kvatlas answers with."""
    unparsed = "malformed" if malformed == 400 else "invalid"
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise refusal(invalid, f"invalid body: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise refusal(malformed, f"{unparsed} body: {exc}") from exc
    except RecursionError as exc:
        raise refusal(malformed, f"{unparsed} body: {TOO_DEEP}") from exc


def union_tags(union: Any) -> frozenset[str]:
    """The tags of a union of tagged msgspec Structs (the operations a protocol knows)."""
    tags: set[str] = set()
    for member in get_args(union) or (union,):
        tag = member.__struct_config__.tag
        if isinstance(tag, str):
            tags.add(tag)
    return frozenset(tags)


class _Op(msgspec.Struct):
    type: str = ""


class RequestHead(msgspec.Struct):
    """What a server reads of a request that did not decode: the version, the id and
    the operation's tag (each left at its default when unreadable)."""

    v: int = 0
    id: int = 0
    body: _Op | None = None

    @property
    def op(self) -> str:
        return self.body.type if self.body is not None else ""


class _Envelope(msgspec.Struct):
    v: int = 0
    id: int = 0


_head = msgspec.msgpack.Decoder(RequestHead)
_envelope = msgspec.msgpack.Decoder(_Envelope)


def decode_head(data: bytes | memoryview) -> RequestHead:
    """Best effort `RequestHead` of a msgpack request (defaults when unreadable)."""
    try:
        return _head.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    try:  # a body that is no map: the version and id may still be readable
        env = _envelope.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return RequestHead()
    return RequestHead(env.v, env.id)


_Q = TypeVar("_Q")
_R = TypeVar("_R")
_E = TypeVar("_E")


class RpcCodec(Generic[_Q, _R, _E]):
    """The msgpack codec of one protocol: requests ``_Q``, responses ``_R``, and the
    envelope ``_E`` (all fields defaulted) read from a message that does not decode."""

    def __init__(self, request: type[_Q], response: type[_R], envelope: type[_E]) -> None:
        self._request = msgspec.msgpack.Decoder(request)
        self._response = msgspec.msgpack.Decoder(response)
        self._envelope = msgspec.msgpack.Decoder(envelope)
        self._empty = envelope
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: _Q | _R) -> bytes:
        return self._encoder.encode(msg)

    def decode_request(self, data: bytes | memoryview) -> _Q:
        """Raise msgspec.DecodeError / ValidationError on a malformed request (also one
        nested too deeply for the decoder's recursion)."""
        try:
            return self._request.decode(data)
        except RecursionError as exc:
            raise msgspec.DecodeError(TOO_DEEP) from exc

    def decode_response(self, data: bytes | memoryview) -> _R:
        return self._response.decode(data)

    def decode_envelope(self, data: bytes | memoryview) -> _E:
        """Best effort header of a message that did not decode (defaults when unreadable)."""
        try:
            return self._envelope.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return self._empty()
