"""FROZEN (see the package docstring): never edit. The first release's tcp data plane
request (``kvatlas.transfer.tcp``): ``u32 length (big endian) + msgpack [peer_id,
token, lease_id, offset, size]``; answered ``">BIQ"`` status (0 ok, 1 refused), message
length, data length, then the message and the data."""

from __future__ import annotations

import struct

import msgspec

RESP = struct.Struct(">BIQ")
LEN = struct.Struct(">I")
MAX_REQUEST = 64 * 1024
ST_OK, ST_REFUSED = 0, 1


class Request(msgspec.Struct, array_like=True, frozen=True):
    peer_id: str
    token: str
    lease_id: str
    offset: int
    size: int


encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(Request).decode
