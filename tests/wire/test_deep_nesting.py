"""Every decoder of what a client or peer sends refuses a body nested past msgspec's
recursion as malformed, instead of raising RecursionError into a
worker loop or a route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kvatlas.core.errors import InvalidInput
from kvatlas.engine.openai_proto import decode_chat, decode_completion
from kvatlas.tokenize.request_shapes import BadRequest, decode_tokenize
from kvatlas.wire import engine_proto, p2p_proto
from kvatlas.wire.directory_api import decode_lookup
from kvatlas.wire.events_api import decode_events
from kvatlas.wire.kafka_records import decode_record

DEPTH = 100_000
DEEP_MSGPACK = b"\x81\xa1v" + b"\x91" * DEPTH + b"\xc0"
DEEP_JSON = b'{"unknown":' + b"[" * DEPTH + b"]" * DEPTH + b"}"

CASES: list[tuple[Callable[[bytes], Any], bytes, type[Exception]]] = [
    (engine_proto.decode_request, DEEP_MSGPACK, msgspec.DecodeError),
    (p2p_proto.decode_request, DEEP_MSGPACK, msgspec.DecodeError),
    (lambda b: decode_events(b, "application/json", 10), DEEP_JSON, InvalidInput),
    (lambda b: decode_events(b, "application/msgpack", 10), DEEP_MSGPACK, InvalidInput),
    (lambda b: decode_lookup(b, "application/json"), DEEP_JSON, InvalidInput),
    (lambda b: decode_record(b, 10), DEEP_JSON, InvalidInput),
    (lambda b: decode_record(b, 10), DEEP_MSGPACK, InvalidInput),
    (decode_chat, DEEP_JSON, BadRequest),
    (decode_completion, DEEP_JSON, BadRequest),
    (decode_tokenize, DEEP_JSON, BadRequest),
]


@pytest.mark.parametrize(("decode", "body", "error"), CASES)
def test_deep_nesting_is_a_malformed_body(
    decode: Callable[[bytes], Any], body: bytes, error: type[Exception]
) -> None:
    with pytest.raises(error):
        decode(body)


def test_envelopes_of_deep_messages_read_as_unreadable() -> None:
    assert engine_proto.decode_envelope(DEEP_MSGPACK) == engine_proto.Envelope()
    assert p2p_proto.decode_envelope(DEEP_MSGPACK) == p2p_proto.P2PEnvelope()
