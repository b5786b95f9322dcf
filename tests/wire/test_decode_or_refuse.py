"""decode_or_refuse: the one way every HTTP surface turns a body that does not decode
into a 4xx within KvatlasError, never a 500."""

from __future__ import annotations

import msgspec
import pytest

from kvatlas.core.errors import HttpRefusal, KvatlasError
from kvatlas.wire.decoding import TOO_DEEP, decode_or_refuse


class Body(msgspec.Struct):
    n: int


class Detail(HttpRefusal):
    """A surface's own words."""


DEC = msgspec.json.Decoder(Body)


@pytest.mark.parametrize(
    ("body", "kw", "status", "reason"),
    [
        (b"{nope", {}, 400, "malformed body"),
        (b'{"n": "x"}', {}, 422, "invalid body: Expected `int`"),
        (b"{nope", {"malformed": 422}, 422, "invalid body"),
        (b'{"n": "x"}', {"invalid": 400}, 400, "invalid body"),
    ],
)
def test_statuses_and_words(body: bytes, kw: dict[str, int], status: int, reason: str) -> None:
    with pytest.raises(Detail) as info:
        decode_or_refuse(DEC, body, Detail, **kw)
    assert isinstance(info.value, KvatlasError)
    assert info.value.status == status and info.value.reason.startswith(reason)


def test_a_body_nested_too_deep_is_malformed_not_a_server_error() -> None:
    with pytest.raises(HttpRefusal) as info:
        decode_or_refuse(msgspec.json.Decoder(), b"[" * 100_000)
    assert (info.value.status, info.value.reason) == (400, f"malformed body: {TOO_DEEP}")


def test_a_good_body_decodes() -> None:
    assert decode_or_refuse(DEC, b'{"n": 3}') == Body(3)
    assert decode_or_refuse(msgspec.msgpack.Decoder(Body), msgspec.msgpack.encode(Body(4))).n == 4
