"""Decoding vLLM's KV-event messages without vLLM: both event encodings, hashes as ints
or digests, unknown types and fields counted, malformed input refused or skipped."""

from __future__ import annotations

import random
import struct

import msgspec
import pytest

from kvatlas.core.device_blocks import Cleared, Removed, Stored, block_key
from kvatlas.wire import vllm_events
from kvatlas.wire.vllm_events import (
    END_SEQ,
    MalformedMessage,
    decode_message,
    is_replay_end,
    replay_request,
)

enc = msgspec.msgpack.Encoder()


def _msg(seq: int, payload: object) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), enc.encode(payload)]


def _u32(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def test_positional_events_with_int_hashes() -> None:
    events = [
        ["BlockStored", [1, 2**64 - 1], None, [5] * 32, 16, None],  # no medium (old vLLM)
        ["BlockRemoved", [1]],
        ["AllBlocksCleared"],
    ]
    b = decode_message(_msg(7, [1.5, events, 0]))
    assert b.seq == 7 and b.dp_rank == 0
    assert b.events == (
        Stored((block_key(1), block_key(2**64 - 1)), None, 16, True, tokens=_u32([5] * 32)),
        Removed((block_key(1),), None),
        Cleared(),
    )
    assert (b.unknown_types, b.malformed_events, b.unknown_fields) == (0, 0, 0)


def test_map_events_with_digests_and_new_fields() -> None:
    digest = bytes(range(32))
    events = [
        {"type": "BlockStored", "block_hashes": [digest], "block_size": 16, "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [digest], "medium": "CPU", "tier_v9": 1},
        {"type": "BlockMoved", "block_hashes": [digest]},
        {"type": "AllBlocksCleared"},
    ]
    b = decode_message(_msg(0, [0.0, events]))
    assert b.events[0] == Stored((block_key(digest),), "CPU", 16, False)  # no token ids
    assert b.events[1] == Removed((block_key(digest),), "CPU")
    assert b.events[2] == Cleared()
    assert (b.unknown_types, b.unknown_fields) == (1, 1)
    assert b.fingerprint != decode_message(_msg(0, [1.0, events])).fingerprint


@pytest.mark.parametrize(
    "event",
    [
        {"block_hashes": [1]},  # no type
        {"type": "BlockStored", "block_hashes": [True]},
        {"type": "BlockStored", "block_hashes": [1.5]},
        {"type": "BlockStored", "block_hashes": 3},
        {"type": "BlockStored", "block_hashes": [b""]},
        {"type": "BlockStored", "block_hashes": [1], "block_size": -1},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": 3},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [-1]},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [2**32]},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": ["7"]},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": 7},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "new_field": 1},
        ["BlockStored", [1], None, [-1], 16],
        ["BlockStored", [1]],
        [],
        42,
    ],
)
def test_malformed_events_are_skipped_not_raised(event: object) -> None:
    good = {"type": "BlockRemoved", "block_hashes": [9]}
    b = decode_message(_msg(1, [0.0, [event, good]]))
    if isinstance(event, dict) and "new_field" in event:  # well formed, one field unknown
        assert b.unknown_fields == 1 and b.malformed_events == 0
        return
    assert b.malformed_events == 1 and b.events == (Removed((block_key(9),), None),)


def _random_event(rng: random.Random) -> object:
    hashes = [rng.choice([rng.getrandbits(64), -rng.getrandbits(63), rng.randbytes(32)])
              for _ in range(rng.randint(0, 4))]  # fmt: skip
    roll = rng.random()
    if roll < 0.6:
        n = len(hashes) * 4
        event: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": rng.choice([None, rng.getrandbits(64)]),
            "token_ids": [rng.randrange(2**32) for _ in range(n)],
            "block_size": 4,
            "medium": rng.choice([None, "GPU", "CPU"]),
            "lora_name": rng.choice([None, "ad"]),
            "extra_keys": rng.choice([None, [["s"]] + [None] * (len(hashes) - 1)]),
            "group_idx": rng.choice([None, 0, 1]),
        }
        if rng.random() < 0.1:
            event["token_ids"] = [rng.choice([-1, 2**32, 3])]  # malformed
        if rng.random() < 0.1:
            event["block_hashes"] = [rng.choice([True, 1.5, "x", b""])]  # malformed
        return event
    if roll < 0.9:
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
    return {"type": "AllBlocksCleared"}


def test_fast_and_general_paths_decode_alike() -> None:
    """The typed fast path (hashes and token ids read from the raw msgpack) and the
    general path give the same events and counts for random batches, malformed events
    included."""
    rng = random.Random(7)
    fast_taken = 0
    for seq in range(300):
        payload = enc.encode(
            [float(seq), [_random_event(rng) for _ in range(rng.randint(0, 6))], 0]
        )
        fast = vllm_events._fast_batch(seq, payload)
        general = vllm_events._general_batch(seq, payload)
        if fast is not None:
            fast_taken += 1
            assert fast == general
    assert fast_taken > 250


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"t", b"\x00" * 8], "3 frames"),
        ([b"t", b"\x00" * 7, b""], "8"),
        ([b"t", END_SEQ, enc.encode([0.0, []])], "negative"),
        ([b"t", b"\x00" * 8, b"\xc1"], "msgpack"),
        ([b"t", b"\x00" * 8, enc.encode("x")], "KVEventBatch"),
        ([b"t", b"\x00" * 8, enc.encode([0.0, 3])], "not a list"),
    ],
)
def test_malformed_messages_raise_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(MalformedMessage, match=reason):
        decode_message(frames)


def test_replay_framing() -> None:
    assert replay_request(5) == [b"", (5).to_bytes(8, "big")]
    assert is_replay_end([b"", END_SEQ, b""])
    assert not is_replay_end([b"t", (3).to_bytes(8, "big"), b"x"])


def test_group_idx_is_carried_and_checked() -> None:
    events = [
        {"type": "BlockStored", "block_hashes": [1], "group_idx": 2},
        {"type": "BlockRemoved", "block_hashes": [1], "group_idx": 1},
        {"type": "BlockRemoved", "block_hashes": [1], "group_idx": -1},
    ]
    b = decode_message(_msg(0, [0.0, events]))
    assert b.events == (
        Stored((block_key(1),), None, 0, False, 2),
        Removed((block_key(1),), None, 1),
    )
    assert b.malformed_events == 1
