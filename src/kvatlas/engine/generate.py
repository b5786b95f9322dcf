"""Prefill with a cached prefix, then decode: the compute half of the reference engine.

Owns one request's model work: build the cache from the prefix chunks the caller got from
its cache server (``kv_layout`` bytes), prefill only the rest, decode greedily or by
temperature/top-p sampling, stream text pieces, and hand back the KV of the full chunks it
computed so that the caller can store them. Must not: talk to a cache server, hash
tokens, or decide what to store (it returns chunks, the caller stores them).

Rules:

- Only full chunks are loaded or returned; a trailing partial chunk is always recomputed.
- At least the last prompt token is always recomputed, because its logits give the first
  token. When every prompt token is covered by cached chunks (the prompt is a multiple of
  the chunk size), all chunks are loaded but the cache is built for the first ``L - 1``
  tokens only, and the last token is prefilled alone: one token of compute rather than a
  whole chunk. The last token's stored KV is simply not used.
- If the cached chunks cannot be built into a cache (wrong size, wrong shape), the whole
  prompt is prefilled instead and ``GenerationResult.fallback`` says why. A stale or
  broken cache entry costs time, never a wrong token.
- Output with a loaded prefix equals full recompute in every test here, but not always bit
  for bit in the logits: splitting a prefill at a different token changes the shapes of
  the matrix products, which moves float32 logits by ~1e-5 (bytes loaded from a cache are
  exact; the split is what differs). Greedy output changes only at near-ties.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
from transformers import DynamicCache

from kvatlas.core.errors import InvalidInput
from kvatlas.engine.kv_cache import KVArena, settle_cache
from kvatlas.engine.kv_layout import (
    DEFAULT_CHUNK_SIZE,
    ChunkBuffer,
    KVLayoutError,
    LayerParts,
    extract_chunks,
    layer_parts,
)
from kvatlas.engine.model import LoadedModel

FirstTokenCallback = Callable[[int, float], None]
"""Called with (token id, seconds since the request started) as soon as it is known."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens; the default is greedy."""

    max_new_tokens: int = 64
    """Upper bound on generated tokens (the stop token is not counted or returned)."""
    temperature: float = 0.0
    """0 means greedy (argmax); above 0 samples from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int | None = None
    """Seed of the sampler (None: nondeterministic); greedy ignores it."""
    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end generation (None: the tokenizer's end-of-sequence tokens)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise InvalidInput("max_new_tokens must not be negative")
        if self.temperature < 0:
            raise InvalidInput("temperature must not be negative")
        if not 0 < self.top_p <= 1:
            raise InvalidInput("top_p must be in (0, 1]")


@dataclass(slots=True)
class Prefill:
    """The state after prefilling a prompt."""

    cache: DynamicCache
    """The model's cache, holding every prompt token."""
    logits: torch.Tensor
    """Logits of the last prompt token (vocab,), float32 or the model dtype."""
    prompt_tokens: int
    cached_tokens: int
    """Leading tokens whose KV came from the given chunks."""
    prefilled_tokens: int
    """Tokens the model computed (prompt_tokens - cached_tokens)."""
    first_new_chunk: int
    """Index of the first full chunk this prefill computed (= chunks loaded)."""
    n_new_chunks: int
    """Full chunks computed here, beyond the cached prefix."""
    build_s: float
    """Seconds spent building the cache from the chunks (views over them: the one copy
    of the prefix into the arena happens in the forward, layer by layer, at each layer's
    first update)."""
    prefill_s: float
    """Seconds of the forward pass over the uncached tokens (with that copy)."""
    fallback: str | None
    """Why the given chunks were not used (None: used, or none given)."""

    def new_chunks(self, chunk_size: int) -> list[npt.NDArray[np.uint8]]:
        """The KV of the full chunks computed here, in the kv_layout (one array each)."""
        start = self.first_new_chunk * chunk_size
        return extract_chunks(self.cache, start, self.n_new_chunks, chunk_size)


@dataclass(slots=True)
class GenerationResult:
    """Everything a request produced, for the caller to answer, store and count."""

    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    ttft_s: float
    """Seconds from the call to the first generated token (prefill included)."""
    build_s: float
    prefill_s: float
    decode_s: float
    token_ids: list[int]
    text: str
    finish_reason: Literal["stop", "length"]
    first_new_chunk: int
    """Chunk index of ``new_chunks[0]``: the prompt's chunks ``[first_new_chunk, ...)``."""
    new_chunks: list[npt.NDArray[np.uint8]] = field(repr=False)
    """KV of the full prompt chunks computed here (kv_layout), for the caller to store."""
    fallback: str | None
    """Why the cached chunks were not used, if they were not (the prompt was recomputed)."""


@torch.inference_mode()
def prefill(
    model: LoadedModel,
    prompt_ids: Sequence[int],
    cached_chunks: Sequence[ChunkBuffer] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    arena: KVArena | None = None,
) -> Prefill:
    """Load the cached prefix and prefill the rest of ``prompt_ids`` (see the module rules).

    ``cached_chunks`` are the prompt's leading full chunks; extra ones are ignored. They
    must stay valid until this returns (leased L1 slots are read where they lie, copied
    once into the model's cache during the forward); the returned cache aliases none.
    The cache lives in ``arena`` (an engine keeps one across requests: its pages stay
    mapped, see ``kv_cache``; a cache made from it earlier may no longer be used), or in
    a fresh arena of its own.
    """
    n = len(prompt_ids)
    if n == 0:
        raise InvalidInput("the prompt is empty")
    if chunk_size <= 0:
        raise InvalidInput(f"chunk size must be positive, got {chunk_size}")
    n_full = n // chunk_size
    chunks = list(cached_chunks or [])[:n_full]
    cached = min(len(chunks) * chunk_size, n - 1)
    fallback: str | None = None
    arena = arena if arena is not None else KVArena(model.kv_spec)
    t0 = time.perf_counter()
    parts: list[LayerParts] | None = None
    if cached > 0:
        try:
            # Views over the chunks (the caller's leased L1 slots): each layer copies its
            # part once, at its first update in the forward below; the caller holds the
            # leases until we return.
            parts = layer_parts(chunks, model.kv_spec, chunk_size, cached)
        except KVLayoutError as exc:
            fallback = f"cached chunks unusable, recomputed the prompt: {exc}"
    if parts is None:
        cached, chunks = 0, []
    cache = arena.cache(model.model.config, parts)
    t1 = time.perf_counter()
    ids = torch.tensor([list(prompt_ids[cached:])], dtype=torch.long)
    out = model.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    settle_cache(cache)  # a layer the forward did not update must not outlive the leases
    t2 = time.perf_counter()
    return Prefill(
        cache=cache,
        logits=out.logits[0, -1],
        prompt_tokens=n,
        cached_tokens=cached,
        prefilled_tokens=n - cached,
        first_new_chunk=len(chunks),
        n_new_chunks=n_full - len(chunks),
        build_s=t1 - t0,
        prefill_s=t2 - t1,
        fallback=fallback,
    )


class Sampler:
    """Turns logits into a token: greedy, or temperature + top-p with a seeded generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._gen: torch.Generator | None = None
        if params.temperature > 0:
            self._gen = torch.Generator()
            if params.seed is not None:
                self._gen.manual_seed(params.seed)
            else:
                self._gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        if self._gen is None:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float() / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p
            sorted_p[before >= self.params.top_p] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self._gen).item())


class Decoder:
    """The decode loop: one-token forward passes on a prefilled cache, until a stop token,
    ``max_new`` tokens or ``cancel``. The reference engine and `_Run` both use it."""

    def __init__(
        self,
        model: LoadedModel,
        cache: DynamicCache,
        sample: Sampler,
        stops: frozenset[int],
        max_new: int,
        *,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.sample = sample
        self.stops = stops
        self.max_new = max_new
        self.cancel = cancel
        self.finish_reason: Literal["stop", "length"] = "length"

    @torch.inference_mode()
    def tokens(self, first: int) -> Iterator[int]:
        """Yield ``first`` and the tokens after it (stop tokens are not yielded)."""
        tok, n = first, 0
        while True:
            if tok in self.stops:
                self.finish_reason = "stop"
                return
            n += 1
            yield tok
            if n >= self.max_new or (self.cancel is not None and self.cancel()):
                return
            out = self.model.model(
                input_ids=torch.tensor([[tok]], dtype=torch.long),
                cache=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            tok = self.sample(out.logits[0, -1])


class Detokenizer:
    """Text pieces as tokens arrive, cut only where the decoded text is stable (no half
    UTF-8 character, no tail a later merge rewrites): the pieces join to the full text."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.emitted = ""

    def add(self, tok: int) -> str:
        self.ids.append(tok)
        text = self._decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        piece, self.emitted = text[len(self.emitted) :], text
        return piece

    def finish(self) -> str:
        text = self._decode(self.ids)
        if text.startswith(self.emitted) and len(text) > len(self.emitted):
            piece, self.emitted = text[len(self.emitted) :], text
            return piece
        return ""


class _Run:
    """One request's token loop and bookkeeping, shared by the stream and the result."""

    def __init__(
        self,
        model: LoadedModel,
        prompt_ids: Sequence[int],
        *,
        cached_chunks: Sequence[ChunkBuffer] | None,
        params: SamplingParams,
        chunk_size: int,
        on_first_token: FirstTokenCallback | None,
    ) -> None:
        self.model = model
        self.prompt_ids = prompt_ids
        self.cached_chunks = cached_chunks
        self.params = params
        self.chunk_size = chunk_size
        self.on_first_token = on_first_token
        stop = params.stop_token_ids
        self.stops = frozenset(model.tokenizer.eos_token_ids if stop is None else stop)
        self.sample = Sampler(params)
        self.pre: Prefill | None = None
        self.ttft_s = 0.0
        self.decode_s = 0.0
        self.finish_reason: Literal["stop", "length"] = "length"
        self.generated: list[int] = []
        self.new_chunks: list[npt.NDArray[np.uint8]] = []

    @torch.inference_mode()
    def tokens(self) -> Iterator[int]:
        t0 = time.perf_counter()
        pre = self.pre = prefill(self.model, self.prompt_ids, self.cached_chunks, self.chunk_size)
        if self.params.max_new_tokens == 0:
            self.ttft_s = time.perf_counter() - t0
            self.new_chunks = pre.new_chunks(self.chunk_size)
            return
        tok = self.sample(pre.logits)
        self.ttft_s = time.perf_counter() - t0
        if self.on_first_token is not None:
            self.on_first_token(tok, self.ttft_s)
        # extracted after the first token so that the copy is not part of the TTFT
        self.new_chunks = pre.new_chunks(self.chunk_size)
        t_dec = time.perf_counter()
        decoder = Decoder(
            self.model, pre.cache, self.sample, self.stops, self.params.max_new_tokens
        )
        try:
            for new in decoder.tokens(tok):
                self.generated.append(new)
                yield new
        finally:
            self.decode_s = time.perf_counter() - t_dec
            self.finish_reason = decoder.finish_reason

    def result(self) -> GenerationResult:
        pre = self.pre
        if pre is None:
            raise RuntimeError("the request has not run")
        return GenerationResult(
            prompt_tokens=pre.prompt_tokens,
            cached_tokens=pre.cached_tokens,
            prefilled_tokens=pre.prefilled_tokens,
            ttft_s=self.ttft_s,
            build_s=pre.build_s,
            prefill_s=pre.prefill_s,
            decode_s=self.decode_s,
            token_ids=list(self.generated),
            text=self.model.tokenizer.decode(self.generated),
            finish_reason=self.finish_reason,
            first_new_chunk=pre.first_new_chunk,
            new_chunks=self.new_chunks,
            fallback=pre.fallback,
        )


class TextStream:
    """Iterate for text pieces as tokens are generated; ``result`` is set at the end.

    Pieces are cut only where the decoded text is stable (no half UTF-8 character), so
    ``"".join(pieces) == result.text``. Nothing runs until the first piece is asked for.
    """

    def __init__(self, run: _Run) -> None:
        self._run = run
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        detok = Detokenizer(self._run.model.tokenizer.decode)
        for tok in self._run.tokens():
            if piece := detok.add(tok):
                yield piece
        self.result = self._run.result()
        if tail := detok.finish():
            yield tail


def stream_generate(
    model: LoadedModel,
    prompt_ids: Sequence[int],
    cached_chunks: Sequence[ChunkBuffer] | None = None,
    params: SamplingParams | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    on_first_token: FirstTokenCallback | None = None,
) -> TextStream:
    """``prefill_and_generate``, streaming: iterate for text pieces, then read ``.result``."""
    run = _Run(
        model,
        prompt_ids,
        cached_chunks=cached_chunks,
        params=params or SamplingParams(),
        chunk_size=chunk_size,
        on_first_token=on_first_token,
    )
    return TextStream(run)


def prefill_and_generate(
    model: LoadedModel,
    prompt_ids: Sequence[int],
    cached_chunks: Sequence[ChunkBuffer] | None = None,
    max_new_tokens: int = 64,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    on_first_token: FirstTokenCallback | None = None,
    params: SamplingParams | None = None,
) -> GenerationResult:
    """Prefill ``prompt_ids`` on top of ``cached_chunks`` and generate.

    ``params`` (default greedy) overrides ``max_new_tokens`` when given. The result
    carries the counts, timings, text and the new full chunks to store.
    """
    params = params or SamplingParams(max_new_tokens=max_new_tokens)
    stream = stream_generate(
        model,
        prompt_ids,
        cached_chunks,
        params,
        chunk_size=chunk_size,
        on_first_token=on_first_token,
    )
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result
