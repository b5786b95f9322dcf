"""A prompt's token ids, as the router keys and looks up by (little-endian uint32).

Owns where a prompt is tokenized: a completion's token-id prompt is used as it is
(`prompt_blob`); else, with ``--tokenizer``, the model's own tokenizer and chat template
in this process (`LocalTokenizer`), on the event loop where a fast encoder makes it
cheap and the tokenizer's thread is idle, else on that one worker thread (a tokenizer
must not be used from two threads at once, and the loop must not wait on one); else an
engine's ``/tokenize`` (engines in turn), given the client's body as it is, so the
engine applies its own chat template and tokenizer. A tokenize that fails or runs past
``lookup_timeout_s`` gives None: the request is routed by load.

Must not: look anything up, choose an engine, or check the fast encoder's ids against
the tokenizer's own (``checks``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Protocol

import httpx
import msgspec
import numpy as np

from kvatlas.core.errors import InvalidInput
from kvatlas.router.clients import EngineClients
from kvatlas.router.config import RouterConfig
from kvatlas.router.engines import EngineState
from kvatlas.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

JSON: Final = "application/json"


class LocalTokenizer(Protocol):
    """The model's tokenizer and chat template in the router's process (``--tokenizer``;
    ``kvatlas.cli.router`` builds one with ``kvatlas.tokenize``, torch-free): a chat or
    completion body -> the prompt's ids as the engine prefills them. Called from one
    thread at a time."""

    @property
    def source(self) -> str:
        """What it was loaded from (the engines' ``--model``), for ``/status`` and logs."""
        ...

    def blob(self, body: bytes) -> bytes:
        """The prompt's ids as little-endian uint32 bytes; InvalidInput for a body the
        engine would refuse too, OverflowError for an id outside uint32."""
        ...

    @property
    def encoder(self) -> str:
        """What encodes text, and why (for ``/status`` and logs)."""
        ...

    def inline_ok(self, body: bytes) -> bool:
        """Whether ``blob(body)`` is cheap enough (well under a few milliseconds) to run
        on the event loop rather than on the tokenizer's thread."""
        ...

    def warm(self) -> None:
        """Pay here, on the calling thread, what its first encode would (a fast encoder
        readies per-thread state), not in a request's time."""
        ...

    def verify(self, body: bytes, blob: bytes) -> bool | None:
        """Whether the tokenizer's own encoder gives ``blob`` for ``body``; None when
        there is nothing to check (no fast encoder). Runs on a thread of its own,
        beside ``blob``."""
        ...

    def distrust(self, why: str) -> None:
        """Stop using the fast encoder (from the next ``blob`` on); any thread."""
        ...

    def cache_stats(self) -> Mapping[str, float]:
        """Its fast encoder's refusals, if it has one (``fast_refused``), and its cache
        of recently encoded text pieces, if it keeps one (``hits``,
        ``misses``, ``hit_tokens``, ``miss_tokens``, ``evictions``, ``entries``,
        ``bytes``, ``max_bytes``); empty when it keeps none. Read from another thread."""
        ...


class _TokenizeAnswer(msgspec.Struct):
    tokens: list[int]


class _TokenIdsPrompt(msgspec.Struct):
    """A completion whose prompt is token ids already: no tokenize needed."""

    prompt: list[int]


_tokenize_answer: Final = msgspec.json.Decoder(_TokenizeAnswer)
_token_ids_prompt: Final = msgspec.json.Decoder(_TokenIdsPrompt)


def uint32(ids: list[int]) -> bytes:
    """Token ids as the little-endian uint32 bytes the router keys and looks up by."""
    return np.asarray(ids, dtype="<u4").tobytes()


def prompt_blob(body: bytes) -> bytes | None:
    """A completion's prompt when it is token ids (the engine prefills exactly those), as
    uint32 bytes; None for any other body (one with an id outside uint32 too)."""
    try:
        return uint32(_token_ids_prompt.decode(body).prompt)
    except (msgspec.DecodeError, msgspec.ValidationError, OverflowError):
        return None


class PromptTokens:
    """Tokenizes prompts for the router (see the module doc); one per router, on its
    event loop."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: LocalTokenizer | None,
        clients: EngineClients,
        metrics: RouterMetrics,
    ) -> None:
        self._config = config
        self.tokenizer = tokenizer
        self._clients = clients
        self._metrics = metrics
        # one thread: a tokenizer must not be used from two threads at once, and the
        # event loop must not wait on one
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="kvatlas-router-tokenize")
            if tokenizer is not None
            else None
        )
        self.busy = 0
        """Calls on the tokenizer's thread not yet finished (queued or running)."""
        self._turn = 0

    async def warm(self) -> None:
        """The tokenizer readied on both threads that call it (this one and its own)."""
        if self.tokenizer is not None and self._pool is not None:
            self.tokenizer.warm()
            await asyncio.get_running_loop().run_in_executor(self._pool, self.tokenizer.warm)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def encode(self, engines: list[EngineState], body: bytes) -> bytes | None:
        """The prompt's ids as uint32 bytes, here (``--tokenizer``, on the tokenizer's
        thread, which also packs them, through its piece cache where it keeps one) or
        from an engine's ``/tokenize``; None when that fails (the request is then routed
        by load, and its engine answers the error)."""
        if self._pool is None:
            return await self._on_engine(engines, body)
        tokenizer = self.tokenizer
        assert tokenizer is not None
        t0 = time.perf_counter()
        try:
            # Inline when it is cheap and the thread is idle (so the tokenizer is never
            # used from two threads at once): the hand-off to a thread and back costs
            # more than a fast encoder takes for a long prompt.
            if not self.busy and tokenizer.inline_ok(body):
                ids = tokenizer.blob(body)
                self._metrics.tokenized.labels("inline").inc()
            else:
                ids = await self._on_thread(tokenizer, body)
                self._metrics.tokenized.labels("thread").inc()
        except (InvalidInput, TimeoutError, OverflowError) as exc:
            log.debug("router: cannot tokenize the prompt here: %r", exc)
            self._metrics.degraded.labels("tokenize").inc()
            return None
        self._metrics.observe("tokenize", time.perf_counter() - t0)
        return ids

    async def _on_thread(self, tokenizer: LocalTokenizer, body: bytes) -> bytes:
        """``tokenizer.blob(body)`` on the tokenizer's thread (TimeoutError past the
        lookup deadline: the call itself runs on, and counts as busy until it ends)."""
        assert self._pool is not None
        work = asyncio.get_running_loop().run_in_executor(self._pool, tokenizer.blob, body)
        self.busy += 1
        work.add_done_callback(self._done)
        return await asyncio.wait_for(asyncio.shield(work), self._config.lookup_timeout_s)

    def _done(self, _: object) -> None:
        self.busy -= 1

    async def _on_engine(self, engines: list[EngineState], body: bytes) -> bytes | None:
        """The prompt's ids from one engine's ``/tokenize`` (engines in turn)."""
        self._turn += 1
        e = engines[self._turn % len(engines)]
        t0 = time.perf_counter()
        try:
            resp = await self._clients.get(e.url).post(
                "/tokenize",
                content=body,
                headers={"content-type": JSON},
                timeout=self._config.lookup_timeout_s,
            )
            if resp.status_code != 200:
                self._metrics.degraded.labels("tokenize").inc()
                return None
            ids = uint32(_tokenize_answer.decode(resp.content).tokens)
        except (httpx.HTTPError, msgspec.DecodeError, OverflowError) as exc:
            log.debug("router: /tokenize on %s failed: %r", e.url, exc)
            self._metrics.degraded.labels("tokenize").inc()
            return None
        self._metrics.observe("tokenize", time.perf_counter() - t0)
        return ids
