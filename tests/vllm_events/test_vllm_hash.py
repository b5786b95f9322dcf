"""Block keys computed by kvatlas equal vLLM's own: `hash_block_tokens` chained by
`get_request_block_hasher` over a real `vllm.v1.request.Request`, for every hash
algorithm, with LoRA and cache-salt extra keys."""

from __future__ import annotations

import random

import pytest

from kvatlas.core.device_blocks import block_key
from kvatlas.core.errors import ConfigError, InvalidInput
from kvatlas.core.vllm_hash import HASH_ALGOS, BlockHasher, DigestMemo, cbor_canonical

kcu = pytest.importorskip(
    "vllm.v1.core.kv_cache_utils", reason="vLLM not installed (scripts/bootstrap.sh)"
)
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.request import Request  # noqa: E402


def _vllm_hashes(
    algo: str,
    seed: str,
    block_size: int,
    tokens: list[int],
    lora: tuple[str, str] | None,
    salt: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> list[bytes]:
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    hasher = kcu.get_request_block_hasher(block_size, fn)
    req = Request(
        "r",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
        cache_salt=salt,
        block_hasher=hasher,
    )
    return [bytes(h) for h in req.block_hashes]


@pytest.mark.parametrize("algo", HASH_ALGOS)
@pytest.mark.parametrize(
    ("lora", "salt"), [(None, None), (("adapter-a", "/loras/a"), None), (None, "tenant-7")]
)
def test_keys_equal_vllms_own(
    algo: str, lora: tuple[str, str] | None, salt: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(f"{algo}{lora}{salt}")
    tokens = [rng.randrange(150_000) for _ in range(16 * 7 + 5)]
    expected = _vllm_hashes(algo, "shared-seed", 16, tokens, lora, salt, monkeypatch)
    ours = BlockHasher(algo, "shared-seed", 16).digests(tokens, lora=lora, cache_salt=salt)
    assert len(expected) == 7
    assert ours == expected
    # The int form vLLM publishes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES names the same key.
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    as_ints = [kcu.maybe_convert_block_hash(kcu.BlockHash(h)) for h in expected]
    assert [block_key(i) for i in as_ints] == [block_key(h) for h in expected]


def test_default_seed_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = get_hash_fn_by_name("sha256_cbor")
    kcu.init_none_hash(fn)
    tokens = list(range(40))
    parent = None
    expected = []
    for i in (0, 16):
        parent = kcu.hash_block_tokens(fn, parent, tokens[i : i + 16], None)
        expected.append(bytes(parent))
    assert BlockHasher("sha256_cbor", block_size=16).digests(tokens) == expected


def test_cbor_matches_cbor2() -> None:
    cbor2 = pytest.importorskip("cbor2")
    for obj in [
        (b"\x00" * 32, tuple(range(0, 70_000, 999)), None),
        (b"x", (0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1, -1, -25), (("a", "é"),)),
        [True, False, None, "", b""],
    ]:
        assert cbor_canonical(obj) == cbor2.dumps(obj, canonical=True)


def test_unknown_algo_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="sha256_cbor"):
        BlockHasher("md5")


def test_cbor_items_at_every_width_equal_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    edges = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]
    tokens = (edges * 4)[:32]
    # vLLM's Request keeps token ids as int32; its hash function takes any.
    monkeypatch.setenv("PYTHONHASHSEED", "s")
    fn = get_hash_fn_by_name("sha256_cbor")
    kcu.init_none_hash(fn)
    first = kcu.hash_block_tokens(fn, None, tokens[:16], (("cache_salt", "salt"),))
    expected = [bytes(first), bytes(kcu.hash_block_tokens(fn, first, tokens[16:], None))]
    assert BlockHasher("sha256_cbor", "s", 16).digests(tokens, cache_salt="salt") == expected
    with pytest.raises(InvalidInput, match="token ids"):
        BlockHasher("sha256_cbor", "s", 16).digests([2**32] * 16)


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_the_memo_gives_the_same_keys_and_hashes_only_new_blocks(algo: str) -> None:
    hasher = BlockHasher(algo, "shared-seed", 16)
    memo = DigestMemo()
    rng = random.Random(algo)
    shared = [rng.randrange(150_000) for _ in range(16 * 6)]
    first = [*shared, *(rng.randrange(150_000) for _ in range(40))]
    second = [*shared, *(rng.randrange(150_000) for _ in range(40))]
    assert hasher.digests(first, memo=memo) == hasher.digests(first)
    assert (memo.hits, memo.misses) == (0, 8)
    assert hasher.digests(second, memo=memo, cache_salt="t") == hasher.digests(
        second, cache_salt="t"
    )
    assert (memo.hits, memo.misses) == (0, 16)  # a salt changes the first block's inputs
    assert hasher.keys(second, memo=memo) == hasher.keys(second)
    assert (memo.hits, memo.misses) == (6, 18)  # the shared prefix came from the memo
    small = DigestMemo(max_entries=4)
    assert hasher.digests(first, memo=small) == hasher.digests(first)
    assert len(small) <= 4
    big = [2**70] * 16  # past int64: hashed without the memo
    if algo.endswith("_cbor"):
        with pytest.raises(InvalidInput):
            hasher.digests(big, memo=memo)
    else:
        assert hasher.digests(big, memo=memo) == hasher.digests(big)
