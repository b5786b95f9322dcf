"""Message shapes of the engine's OpenAI-compatible HTTP API (msgspec Structs).

Owns the request bodies of ``/v1/chat/completions`` and ``/v1/completions`` (typed
decoding; unknown fields such as ``frequency_penalty`` are accepted and ignored, as
OpenAI clients send them freely), the response and stream-chunk bodies, the model list,
OpenAI-style error bodies, and kvatlas' extension: a request with
``"kv_transfer_params": {"cached_token_stats": true}`` gets ``cached_token_stats`` in its
answer (the name LMCache's vLLM connector uses; ``num_cached_tokens`` is LMCache's
``num_lmcache_cached_tokens``).

Encoding and shapes only: no I/O, no state, no model. Must not: hold defaults that
belong to the engine's configuration (the server applies those). The shapes a prompt is
tokenized from (``ChatMessage``, ``TokenizeRequest``) and ``BadRequest`` are
in ``kvatlas.tokenize.request_shapes``, which the router's tokenizer shares.
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvatlas.tokenize.request_shapes import BadRequest, ChatMessage, decode_body

FinishReason = str
"""``stop`` or ``length``."""
MAX_CACHE_SALT: Final = 256
"""The longest ``cache_salt`` a request may carry (characters)."""


# ---- requests -----------------------------------------------------------------------


class KVTransferParams(msgspec.Struct, frozen=True):
    cached_token_stats: bool = False
    """Answer with ``cached_token_stats`` (also in the last streamed chunk)."""


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _Generation(msgspec.Struct, frozen=True, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    """None: 1.0, as OpenAI; 0 is greedy."""
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    """vLLM's extension: keep generating past end-of-sequence tokens up to max_tokens."""
    kv_transfer_params: KVTransferParams | None = None
    user: str | None = None
    cache_salt: str | None = None
    """vLLM's field: the namespace of this request's KV. The prompt hits only KV stored
    under the same salt (none matches none), at every tier of the fleet. A router with
    tenants sets it from the API key; a client's own is as trustworthy as the client."""

    def salt(self) -> str:
        """The request's ``cache_salt`` ("" for none); BadRequest for an empty or
        overlong one (vLLM refuses an empty salt too)."""
        if self.cache_salt is None:
            return ""
        if not self.cache_salt or len(self.cache_salt) > MAX_CACHE_SALT:
            raise BadRequest(
                f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT}"
                " characters if given",
                "cache_salt",
            )
        return self.cache_salt

    @property
    def wants_cache_stats(self) -> bool:
        return self.kv_transfer_params is not None and self.kv_transfer_params.cached_token_stats

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > 4:
            raise BadRequest("at most 4 stop sequences are supported", "stop")
        if any(not s for s in stops):
            raise BadRequest("stop sequences must not be empty", "stop")
        return stops


class ChatCompletionRequest(_Generation, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_Generation, frozen=True, kw_only=True):
    prompt: str | list[int | str]
    """A string, or token ids; a list holding one string is that string (batches of
    prompts are not supported)."""
    echo: bool = False


class TokenizeResponse(msgspec.Struct, frozen=True):
    count: int
    max_model_len: int
    tokens: list[int]


_chat_decoder: Final = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder: Final = msgspec.json.Decoder(CompletionRequest)


def decode_chat(body: bytes) -> ChatCompletionRequest:
    """Decode a chat request; BadRequest says what is wrong."""
    return decode_body(_chat_decoder, body)


def decode_completion(body: bytes) -> CompletionRequest:
    """Decode a completion request; BadRequest says what is wrong."""
    return decode_body(_completion_decoder, body)


# ---- responses ----------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CachedTokenStats(msgspec.Struct, frozen=True):
    """Where one request's prompt KV came from, and what it cost."""

    num_cached_tokens: int
    """Prompt tokens whose KV was loaded from the cache server (local or peers)."""
    num_peer_cached_tokens: int
    """Of those, tokens the server read from peers (P2P) for this request."""
    num_prefilled_tokens: int
    """Prompt tokens the model computed."""
    num_prompt_tokens: int
    ttft_ms: float
    """Milliseconds from the request's arrival to its first token."""
    load_ms: float
    """Milliseconds of lookup, verification and building the cache from the chunks."""
    fallback: str | None
    """Why cached KV could not be used (a cause such as ``server_unavailable``), or null."""
    breakdown_ms: dict[str, float] = {}
    """kvatlas: where the time to first token went: ``lookup`` (the engine's round trip
    to its cache server, P2P included) and, when the server asked peers, its
    ``p2p_local_lookup``, ``p2p_directory``, ``p2p_lock``, ``p2p_reserve``,
    ``p2p_transfer`` (checksums included), ``p2p_commit``, ``p2p_unlock``; then ``verify``
    (checksums in the engine), ``build_cache`` (KV bytes into the model's cache) and
    ``prefill`` (the suffix the cache did not cover)."""


class AssistantMessage(msgspec.Struct, frozen=True):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    cached_token_stats: CachedTokenStats | None = None


class Delta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    cached_token_stats: CachedTokenStats | None = None


class CompletionChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None


class Completion(msgspec.Struct, frozen=True, omit_defaults=True):
    """A ``text_completion`` answer, and (with ``usage`` None) a streamed chunk of one."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    cached_token_stats: CachedTokenStats | None = None


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int
    root: str
    """The model's name in the hash contract."""


class ModelList(msgspec.Struct, frozen=True):
    object: str
    data: list[ModelCard]


class ErrorBody(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, frozen=True):
    error: ErrorBody


_encoder: Final = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)
