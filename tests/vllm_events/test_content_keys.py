"""Issue #38 item 1: the device tier keys blocks by the token ids the events carry.

vLLM's own `ZmqEventPublisher` publishes vLLM's own block hashes (its
`get_request_block_hasher`, so LoRA and salt extra keys are vLLM's) to a `VllmIngest`:
prompts that continue a stored one in a later event (a parent), a LoRA's and a salted
request's blocks match only their own prompts; Dynamo-style local hashes answer the
same; a source configured with another hash than the engine's is reported, and lookups
are not affected."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvatlas.coordinator.vllm.ingest import VllmIngest
from kvatlas.coordinator.vllm.sources import parse_source
from kvatlas.core.coordinator.block_table import DYNAMO_SEED, local_hashes
from kvatlas.core.device_blocks import EngineId
from support.wait import wait_until

from .test_vllm_ingest import BLOCK, _batch, _port, _publisher, kv_events

hashing = pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vLLM not installed")
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.request import Request  # noqa: E402


def _hashes(tokens: list[int], *, lora: str | None = None, salt: str | None = None) -> Any:
    """vLLM's block hashes of a request (its own hasher), as its publisher sends them
    (64-bit ints), and the extra keys it publishes per block."""
    hashing.init_none_hash(sha256_cbor)
    request = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        lora_request=LoRARequest(lora, 1, "/adapters/" + lora) if lora else None,
        cache_salt=salt,
        block_hasher=hashing.get_request_block_hasher(BLOCK, sha256_cbor),
    )
    ints = [int.from_bytes(h, "big") & (2**64 - 1) for h in request.block_hashes]
    extras: list[Any] = []
    for i in range(len(ints)):
        keys: list[Any] = [lora] if lora else []
        if salt and i == 0:
            keys.append(salt)
        extras.append(tuple(keys) or None)
    return ints, extras


def _store(tokens: list[int], first: int, blocks: int, **kw: Any) -> Any:
    """BlockStored of blocks [first, first + blocks) of the request, as vLLM sends it."""
    ints, extras = _hashes(tokens, lora=kw.get("lora"), salt=kw.get("salt"))
    return kv_events.BlockStored(
        block_hashes=ints[first : first + blocks],
        parent_block_hash=ints[first - 1] if first else None,
        token_ids=tokens[first * BLOCK : (first + blocks) * BLOCK],
        block_size=BLOCK,
        lora_id=1 if kw.get("lora") else None,
        medium="GPU",
        lora_name=kw.get("lora"),
        extra_keys=extras[first : first + blocks] if any(extras) else None,
    )


def _prompt(i: int, blocks: int = 4) -> list[int]:
    return [i * 1000 + t for t in range(blocks * BLOCK)]


def _tokens_of(ing: VllmIngest, tokens: list[int], **kw: Any) -> int:
    hits = ing.lookup(tokens, **kw)
    return next(h.tokens for h in hits if h.engine == "e1")


def test_lookups_follow_parents_lora_and_salt_and_report_a_wrong_hash() -> None:
    ports = _port(), _port()
    pub = _publisher(*ports)
    # The engine hashes with sha256_cbor; the source says sha256 (vLLM's default here).
    spec = f"e1=tcp://127.0.0.1:{ports[0]},replay=tcp://127.0.0.1:{ports[1]},topic=kv-events"
    ing = VllmIngest(parse_source(spec), replay_timeout_s=1.0)
    registry = CollectorRegistry()
    ing.attach(registry)
    try:
        ing.start()
        wait_until(lambda: ing.stats()["e1"]["replays"], lambda n: n >= 1, what="connect")
        doc, lora, salted = _prompt(1), _prompt(2), _prompt(3)
        pub.publish(_batch(_store(doc, 0, 2), _store(lora, 0, 4, lora="ad-1")))
        pub.publish(_batch(_store(doc, 2, 2), _store(salted, 0, 4, salt="tenant-x")))
        wait_until(lambda: ing.stats()["e1"]["last_seq"], lambda s: s == 1, what="both batches")

        assert _tokens_of(ing, [*doc, 7]) == 4 * BLOCK  # blocks 2-3 chained onto 0-1
        assert _tokens_of(ing, doc[2 * BLOCK :]) == 0
        assert _tokens_of(ing, lora) == 0
        assert _tokens_of(ing, lora, lora_name="ad-1") == 4 * BLOCK
        assert _tokens_of(ing, lora, lora_name="ad-2") == 0
        assert _tokens_of(ing, salted) == 0
        assert _tokens_of(ing, salted, cache_salt="tenant-x") == 4 * BLOCK
        assert _tokens_of(ing, salted, cache_salt="tenant-y") == 0

        # Dynamo's /query_by_hash input: the blocks' local hashes.
        raw = local_hashes(doc, BLOCK, DYNAMO_SEED)
        locals_ = [v for (v,) in struct.iter_unpack("<Q", raw)]
        hit = next(h for h in ing.lookup_by_local_hashes(locals_) if h.engine == "e1")
        assert hit.tokens == 4 * BLOCK

        dumped = {d.block_hash: d for d in ing.dump()[EngineId("e1")]}
        ints, _ = _hashes(doc)
        assert dumped[ints[2]].parent_hash == ints[1] and dumped[ints[0]].parent_hash is None
        assert dumped[ints[3]].tokens_hash == locals_[3]

        s = ing.stats()["e1"]
        assert s["hash_mismatches"] >= 1 and s["hash_matches"] == 0
        assert s["unchained_blocks"] == 0
        text = generate_latest(registry).decode()
        assert 'kvatlas_vllm_events_hash_mismatches_total{engine="e1"}' in text
    finally:
        ing.stop()
        pub.shutdown()


def test_a_source_with_the_engines_hash_is_confirmed() -> None:
    ports = _port(), _port()
    pub = _publisher(*ports)
    spec = (
        f"e1=tcp://127.0.0.1:{ports[0]},replay=tcp://127.0.0.1:{ports[1]},"
        f"topic=kv-events,hash=sha256_cbor"
    )
    ing = VllmIngest(parse_source(spec), replay_timeout_s=1.0)
    try:
        ing.start()
        pub.publish(_batch(_store(_prompt(1), 0, 4), _store(_prompt(2), 0, 4, salt="s")))
        wait_until(lambda: ing.stats()["e1"]["last_seq"], lambda s: s == 0, what="the batch")
        s = ing.stats()["e1"]
        # The salted store is not checked (its first block's hash needs the salt).
        assert (s["hash_matches"], s["hash_mismatches"]) == (1, 0)
    finally:
        ing.stop()
        pub.shutdown()
