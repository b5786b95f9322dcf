"""FROZEN (see the package docstring): never edit. The msgpack request/response codec
of the first release (``kvatlas.wire.decoding.RpcCodec``)."""

from __future__ import annotations

from typing import Final, Generic, TypeVar

import msgspec

TOO_DEEP: Final = "nested deeper than the decoder's recursion limit"

_Q = TypeVar("_Q")
_R = TypeVar("_R")
_E = TypeVar("_E")


class RpcCodec(Generic[_Q, _R, _E]):
    def __init__(self, request: type[_Q], response: type[_R], envelope: type[_E]) -> None:
        self._request = msgspec.msgpack.Decoder(request)
        self._response = msgspec.msgpack.Decoder(response)
        self._envelope = msgspec.msgpack.Decoder(envelope)
        self._empty = envelope
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, msg: _Q | _R) -> bytes:
        return self._encoder.encode(msg)

    def decode_request(self, data: bytes | memoryview) -> _Q:
        try:
            return self._request.decode(data)
        except RecursionError as exc:
            raise msgspec.DecodeError(TOO_DEEP) from exc

    def decode_response(self, data: bytes | memoryview) -> _R:
        return self._response.decode(data)

    def decode_envelope(self, data: bytes | memoryview) -> _E:
        try:
            return self._envelope.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return self._empty()
