"""LMCache 0.5.6 MP framing without LMCache: what decodes, what is refused and why."""

from __future__ import annotations

import msgspec
import pytest

from kvatlas.server.lmcache_mp.wire import (
    IpcDescriptor,
    IPCKey,
    WireError,
    decode_request,
    encode_reply,
    error_reply,
)

enc = msgspec.msgpack.encode


def key_map(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "model_name": "m",
        "world_size": 1,
        "worker_id": 0,
        "token_ids": [1, 2, 3],
        "start": 0,
        "end": 3,
        "request_id": "r",
        "cache_salt": "",
        "request_configs": None,
        "num_kv_readers": 1,
    }
    return {**base, **over}


def test_operations_by_legacy_id_and_by_name() -> None:
    req = decode_request([b"id", enc(7), enc(8), enc(key_map()), enc(1)])
    assert req.operation == "lookup"
    got, tp = req.args
    assert isinstance(got, IPCKey) and tp == 1
    want = IPCKey("m", 1, 0, [1, 2, 3], 0, 3, "r", "", None, 1)
    assert msgspec.structs.astuple(got) == msgspec.structs.astuple(want)
    assert decode_request([b"id", enc(8), enc("get_chunk_size")]).operation == "get_chunk_size"
    reply = encode_reply(decode_request([b"id", enc(9), enc(21)]), 256)
    assert reply == [b"id", enc(9), enc(21), enc(256)]
    # a None result is an absent frame, as LMCache sends it
    assert encode_reply(decode_request([b"id", enc(9), enc(13), enc("r")]), None) == [
        b"id",
        enc(9),
        enc(13),
    ]


def test_a_newer_key_field_is_skipped_and_said() -> None:
    req = decode_request([b"i", enc(1), enc(8), enc(key_map(future_field=1)), enc(1)])
    assert isinstance(req.args[0], IPCKey) and req.args[0].request_id == "r"
    assert req.unknown_fields
    assert not decode_request([b"i", enc(1), enc(8), enc(key_map()), enc(1)]).unknown_fields


@pytest.mark.parametrize(
    ("frames", "reason", "says"),
    [
        ([b"i", enc(1), enc(11), enc("r")], "version", "retired in LMCache 0.5.6"),
        ([b"i", enc(1), enc(77)], "version", "not in LMCache 0.5.6"),
        ([b"i", enc(1), enc("lookup_v9")], "version", "not in LMCache 0.5.6"),
        ([b"i", enc(1), enc(22)], "version", "ping carries 0 arguments"),
        ([b"i", enc(1), enc(8), enc({"x": 1}), enc(1)], "version", "lookup argument 0"),
        ([b"i", enc(1), enc(25), enc(1)], "unsupported", "cb_register_rope"),
        ([b"i", enc(1), b"\xc1"], "malformed", "not msgpack"),
        ([b"i", b"\xc1", enc(21)], "malformed", "request id"),
        ([b"i", enc(1)], "malformed", "need uid and operation"),
    ],
)
def test_refusals_name_their_reason(frames: list[bytes], reason: str, says: str) -> None:
    with pytest.raises(WireError) as err:
        decode_request(frames)
    assert err.value.reason == reason
    assert says in str(err.value)


def test_error_reply_fails_the_clients_future_with_the_reason() -> None:
    out = error_reply([b"i", enc(5), enc(21)], "no")
    assert out == [b"i", enc(5), enc("error: no")]
    assert error_reply([b"i"], "x")[1] == enc(-1)


def test_cpu_shm_descriptor_in_extension_1() -> None:
    desc = {
        "type": "cpu_shm",
        "version": 1,
        "metadata": {
            "dtype": "float32",
            "shape": [2, 4],
            "stride": [4, 1],
            "storage_offset": 0,
            "device_uuid": "cpu",
        },
        "shm_name": "/lmcache_kv_x",
        "nbytes": 32,
    }
    ext = msgspec.msgpack.Ext(1, enc(desc))
    frames = [
        b"i",
        enc(1),
        enc(1),
        enc(7),
        enc([ext]),
        enc("m"),
        enc(1),
        enc("vllm"),
        enc({}),
        enc([]),
    ]
    req = decode_request(frames)
    (d,) = req.args[1]
    assert isinstance(d, IpcDescriptor)
    assert (d.type, d.shm_name, d.nbytes) == ("cpu_shm", "/lmcache_kv_x", 32)
    bad = [*frames[:4], enc([msgspec.msgpack.Ext(2, b"")]), *frames[5:]]
    with pytest.raises(WireError):
        decode_request(bad)
