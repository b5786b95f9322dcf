"""The engine's OpenAI-compatible HTTP API (Starlette): requests in, model work out.

Owns the HTTP edge of ``kvatlas engine``: ``POST /v1/chat/completions`` (messages through
the model's chat template), ``POST /v1/completions`` (a prompt string or token ids),
``POST /tokenize`` (the prompt's token ids as the model will see them, for a router),
``GET /v1/models``, ``GET /healthz`` and ``GET /metrics`` (prompts become ids through
``kvatlas.tokenize.prompts``, the definition a router's ``--tokenizer`` shares);
validating requests into
``GenRequest`` (bad input is a 400 with an OpenAI-style error body, never a 500);
answering in OpenAI's shapes, or streaming them as server-sent events (``data: {...}``
chunks ending with ``data: [DONE]``); the ``cached_token_stats`` extension.

It also defines what it needs of the model worker (``ModelWorker``, ``GenRequest``,
``GenOutcome``); ``engine_app.EngineCore`` provides it. Must not: run the model on the
event loop (everything model-related goes through ``ModelWorker.submit``, one request at
a time; a request's own tokenizing too, so it never runs beside its decode on another
tokenizer; ``/tokenize`` alone goes through ``ModelWorker.tokenize``, a copy of the
tokenizer on a thread of its own, so that a router's question does not wait behind the
model), talk to the cache server, or read configuration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Generic, Protocol, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvatlas.connector.kv_connector import KVLoadFailed
from kvatlas.core.errors import InvalidInput
from kvatlas.engine.generate import SamplingParams
from kvatlas.engine.model import LoadedModel, Tokenizer
from kvatlas.engine.openai_proto import (
    AssistantMessage,
    CachedTokenStats,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ErrorBody,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeResponse,
    Usage,
    decode_chat,
    decode_completion,
    encode,
)
from kvatlas.tokenize.prompts import chat_ids, prompt_ids, tokenize_ids
from kvatlas.tokenize.request_shapes import BadRequest, decode_tokenize

log = logging.getLogger(__name__)

_T = TypeVar("_T")
TextCallback = Callable[[str], None]
JSON: Final = "application/json"
CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
TOKENIZE: Final = "/tokenize"
_DONE: Final = b"data: [DONE]\n\n"
_MAX_TEMPERATURE: Final = 2.0


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One validated request for the model worker."""

    prompt_ids: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...] = ()
    arrival: float = 0.0
    """``time.perf_counter()`` when the request arrived (TTFT counts from here)."""
    cache_salt: str = ""
    """The namespace of the prompt's KV (the request's ``cache_salt``; "" for none)."""


@dataclass(frozen=True, slots=True)
class GenOutcome:
    """What one request produced, with where its prompt KV came from."""

    text: str
    completion_tokens: int
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    peer_cached_tokens: int
    prefilled_tokens: int
    ttft_s: float
    load_s: float
    decode_s: float
    fallback: str | None
    stored_chunks: int
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    """Where the time to first token went (see ``CachedTokenStats.breakdown_ms``)."""


class ModelWorker(Protocol):
    """What the HTTP edge needs of the engine's model worker."""

    model: LoadedModel
    max_model_len: int
    vocab_size: int
    default_max_tokens: int

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run ``fn`` on the model worker thread, after what was submitted before."""
        ...

    def tokenize(self, fn: Callable[[Tokenizer], _T]) -> Future[_T]:
        """Run ``fn`` with a tokenizer of its own, on a thread beside the model's."""
        ...

    def generate(
        self,
        req: GenRequest,
        on_text: TextCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> GenOutcome:
        """Serve one request (on the worker thread); ``on_text`` gets text pieces."""
        ...

    def count_request(self, endpoint: str, code: int) -> None: ...

    def render_metrics(self) -> bytes: ...

    def health(self) -> dict[str, object]: ...


def build_app(worker: ModelWorker, *, served_name: str) -> Starlette:
    """The Starlette app of the engine's HTTP API."""
    api = _Api(worker, served_name)
    return Starlette(
        routes=[
            Route(CHAT, api.chat, methods=["POST"]),
            Route(COMPLETIONS, api.completions, methods=["POST"]),
            Route(TOKENIZE, api.tokenize, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/healthz", api.healthz, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
        ]
    )


def _stats(out: GenOutcome) -> CachedTokenStats:
    return CachedTokenStats(
        num_cached_tokens=out.cached_tokens,
        num_peer_cached_tokens=out.peer_cached_tokens,
        num_prefilled_tokens=out.prefilled_tokens,
        num_prompt_tokens=out.prompt_tokens,
        ttft_ms=round(out.ttft_s * 1000, 3),
        load_ms=round(out.load_s * 1000, 3),
        fallback=out.fallback,
        breakdown_ms={k: round(v, 3) for k, v in out.breakdown_ms.items()},
    )


def _usage(out: GenOutcome) -> Usage:
    return Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        total_tokens=out.prompt_tokens + out.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.cached_tokens),
    )


def _sse(msg: msgspec.Struct) -> bytes:
    return b"data: " + encode(msg) + b"\n\n"


class _Api:
    def __init__(self, worker: ModelWorker, served_name: str) -> None:
        self.worker = worker
        self.served_name = served_name
        self.names = {served_name, worker.model.name}
        self.created = int(time.time())

    # ------------------------------------------------------------------ helpers

    async def _on_worker(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.wrap_future(self.worker.submit(fn))

    def _error(
        self,
        endpoint: str,
        code: int,
        message: str,
        kind: str,
        *,
        param: str | None = None,
        err_code: str | None = None,
    ) -> Response:
        self.worker.count_request(endpoint, code)
        body = ErrorResponse(ErrorBody(message, kind, param, err_code))
        return Response(encode(body), status_code=code, media_type=JSON)

    def _not_found(self, endpoint: str, exc: _ModelNotFound) -> Response:
        return self._error(
            endpoint, 404, str(exc), "not_found_error", param="model", err_code="model_not_found"
        )

    def _bad(self, endpoint: str, exc: InvalidInput) -> Response:
        param = exc.param if isinstance(exc, BadRequest) else None
        return self._error(endpoint, 400, str(exc), "invalid_request_error", param=param)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise _ModelNotFound(f"the model {name!r} does not exist; this engine serves"
                                 f" {self.served_name!r}")  # fmt: skip

    def _gen_request(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        ids: list[int],
        max_tokens: int | None,
        arrival: float,
    ) -> GenRequest:
        if req.n != 1:
            raise BadRequest("only n=1 is supported", "n")
        if not ids:
            raise BadRequest("the prompt is empty", "prompt")
        limit = self.worker.max_model_len
        if len(ids) >= limit:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens; this model's context length is {limit}"
                " (--max-model-len), which must leave room for at least one new token",
                "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        if max_tokens is None:
            max_tokens = self.worker.default_max_tokens
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        temperature = 1.0 if req.temperature is None else req.temperature
        if not 0 <= temperature <= _MAX_TEMPERATURE:
            raise BadRequest(
                f"temperature must be in [0, {_MAX_TEMPERATURE}], got {temperature}", "temperature"
            )
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0 < top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
        try:
            params = SamplingParams(
                max_new_tokens=min(max_tokens, limit - len(ids)),
                temperature=temperature,
                top_p=top_p,
                seed=req.seed,
                stop_token_ids=() if req.ignore_eos else None,
            )
        except InvalidInput as exc:
            raise BadRequest(str(exc)) from exc
        return GenRequest(ids, params, req.stop_strings(), arrival, req.salt())

    # ------------------------------------------------------------------ endpoints

    async def chat(self, request: Request) -> Response:
        arrival = time.perf_counter()
        try:
            req = decode_chat(await request.body())
            self._check_model(req.model)
            tok = self.worker.model.tokenizer
            ids = await self._on_worker(lambda: chat_ids(tok, req.messages))
            max_tokens = req.max_completion_tokens or req.max_tokens
            gen = self._gen_request(req, ids, max_tokens, arrival)
        except _ModelNotFound as exc:
            return self._not_found(CHAT, exc)
        except InvalidInput as exc:
            return self._bad(CHAT, exc)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return self._stream(CHAT, gen, _ChatChunks(rid, created, self.served_name, req))
        out = await self._run(CHAT, gen)
        if isinstance(out, Response):
            return out
        body = ChatCompletion(
            id=rid,
            object="chat.completion",
            created=created,
            model=self.served_name,
            choices=[ChatChoice(0, AssistantMessage(out.text), out.finish_reason)],
            usage=_usage(out),
            cached_token_stats=_stats(out) if req.wants_cache_stats else None,
        )
        self.worker.count_request(CHAT, 200)
        return Response(encode(body), media_type=JSON)

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        try:
            req = decode_completion(await request.body())
            self._check_model(req.model)
            if req.echo:
                raise BadRequest("echo is not supported", "echo")
            tok = self.worker.model.tokenizer
            vocab = self.worker.vocab_size
            ids = await self._on_worker(lambda: prompt_ids(tok, req.prompt, vocab))
            gen = self._gen_request(req, ids, req.max_tokens, arrival)
        except _ModelNotFound as exc:
            return self._not_found(COMPLETIONS, exc)
        except InvalidInput as exc:
            return self._bad(COMPLETIONS, exc)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return self._stream(
                COMPLETIONS, gen, _CompletionChunks(rid, created, self.served_name, req)
            )
        out = await self._run(COMPLETIONS, gen)
        if isinstance(out, Response):
            return out
        body = Completion(
            id=rid,
            object="text_completion",
            created=created,
            model=self.served_name,
            choices=[CompletionChoice(0, out.text, out.finish_reason)],
            usage=_usage(out),
            cached_token_stats=_stats(out) if req.wants_cache_stats else None,
        )
        self.worker.count_request(COMPLETIONS, 200)
        return Response(encode(body), media_type=JSON)

    async def tokenize(self, request: Request) -> Response:
        """The prompt's token ids, exactly as ``chat``/``completions`` would prefill them."""
        try:
            req = decode_tokenize(await request.body())
            self._check_model(req.model)
            vocab = self.worker.vocab_size
            ids = await asyncio.wrap_future(
                self.worker.tokenize(lambda tok: tokenize_ids(tok, req, vocab))
            )
        except _ModelNotFound as exc:
            return self._not_found(TOKENIZE, exc)
        except InvalidInput as exc:
            return self._bad(TOKENIZE, exc)
        self.worker.count_request(TOKENIZE, 200)
        body = TokenizeResponse(len(ids), self.worker.max_model_len, ids)
        return Response(encode(body), media_type=JSON)

    async def _run(self, endpoint: str, gen: GenRequest) -> GenOutcome | Response:
        try:
            return await self._on_worker(lambda: self.worker.generate(gen))
        except KVLoadFailed as exc:
            return self._error(endpoint, 503, str(exc), "service_unavailable", err_code="kv_load")
        except InvalidInput as exc:
            return self._bad(endpoint, exc)
        except Exception:
            log.exception("request to %s failed", endpoint)
            return self._error(endpoint, 500, "internal error; see the engine log", "server_error")

    def _stream(self, endpoint: str, gen: GenRequest, shape: _Chunks[Any]) -> Response:
        self.worker.count_request(endpoint, 200)
        return StreamingResponse(self._events(endpoint, gen, shape), media_type="text/event-stream")

    async def _events(
        self, endpoint: str, gen: GenRequest, shape: _Chunks[Any]
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        cancel = threading.Event()

        def push(item: str | None) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone: nobody is listening
                cancel.set()

        fut = self.worker.submit(lambda: self.worker.generate(gen, push, cancel))
        fut.add_done_callback(lambda _f: push(None))
        try:
            for first in shape.first():
                yield _sse(first)
            while (piece := await queue.get()) is not None:
                yield _sse(shape.piece(piece))
            try:
                out = fut.result()
            except Exception as exc:
                if not isinstance(exc, InvalidInput | KVLoadFailed):
                    log.exception("streamed request to %s failed", endpoint)
                kind = "service_unavailable" if isinstance(exc, KVLoadFailed) else "server_error"
                yield _sse(ErrorResponse(ErrorBody(str(exc), kind)))
                yield _DONE
                return
            for last in shape.final(out):
                yield _sse(last)
            yield _DONE
        finally:
            cancel.set()  # a client that went away stops the decode loop

    async def models(self, _: Request) -> Response:
        card = ModelCard(
            id=self.served_name,
            object="model",
            created=self.created,
            owned_by="kvatlas",
            max_model_len=self.worker.max_model_len,
            root=self.worker.model.name,
        )
        self.worker.count_request("/v1/models", 200)
        return Response(encode(ModelList("list", [card])), media_type=JSON)

    async def healthz(self, _: Request) -> Response:
        return Response(msgspec.json.encode(self.worker.health()), media_type=JSON)

    async def metrics(self, _: Request) -> Response:
        return Response(self.worker.render_metrics(), media_type="text/plain; version=0.0.4")


class _ModelNotFound(Exception):
    """A request naming a model this engine does not serve (404)."""


_Choice = TypeVar("_Choice", ChatChunkChoice, CompletionChoice)


class _Chunks(ABC, Generic[_Choice]):
    """The chunks of one streamed answer: a piece per text, then the finish reason with the
    cached-token stats (and the usage, in a chunk of its own, when the client asked)."""

    _struct: ClassVar[Callable[..., msgspec.Struct]]
    _object: ClassVar[str]
    """The chunk's type and its ``object`` field."""

    def __init__(
        self, rid: str, created: int, model: str, req: ChatCompletionRequest | CompletionRequest
    ) -> None:
        self.rid, self.created, self.model, self.req = rid, created, model, req

    def _chunk(
        self,
        choices: list[_Choice],
        usage: Usage | None = None,
        stats: CachedTokenStats | None = None,
    ) -> msgspec.Struct:
        return self._struct(self.rid, self._object, self.created, self.model, choices, usage, stats)

    @abstractmethod
    def _choice(self, text: str | None, finish_reason: FinishReason | None) -> _Choice:
        """The choice carrying ``text`` (None: the last one, carrying no text)."""

    def first(self) -> Sequence[msgspec.Struct]:
        return []

    def piece(self, text: str) -> msgspec.Struct:
        return self._chunk([self._choice(text, None)])

    def final(self, out: GenOutcome) -> Sequence[msgspec.Struct]:
        stats = _stats(out) if self.req.wants_cache_stats else None
        done = self._choice(None, out.finish_reason)
        if not self.req.include_usage:
            return [self._chunk([done], stats=stats)]
        return [self._chunk([done]), self._chunk([], _usage(out), stats)]


class _ChatChunks(_Chunks[ChatChunkChoice]):
    """``chat.completion.chunk`` objects of one streamed chat answer."""

    _struct = ChatCompletionChunk
    _object = "chat.completion.chunk"

    def _choice(self, text: str | None, finish_reason: FinishReason | None) -> ChatChunkChoice:
        return ChatChunkChoice(0, Delta() if text is None else Delta(content=text), finish_reason)

    def first(self) -> Sequence[msgspec.Struct]:
        return [self._chunk([ChatChunkChoice(0, Delta(role="assistant", content=""), None)])]


class _CompletionChunks(_Chunks[CompletionChoice]):
    """``text_completion`` chunks of one streamed completion."""

    _struct = Completion
    _object = "text_completion"

    def _choice(self, text: str | None, finish_reason: FinishReason | None) -> CompletionChoice:
        return CompletionChoice(0, "" if text is None else text, finish_reason)
