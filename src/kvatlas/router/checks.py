"""Checks of the router's fast encoder against the tokenizer's own, on live prompts.

Owns, with ``--tokenizer`` and ``tokenizer_verify_every`` set, one prompt in that many
encoded again by the tokenizer's own encoder on a thread of its own (a check must not
queue the next prompts behind it on the tokenizer's thread), after the request was
routed (its CPU does not delay that request's lookup), one check at a time; a mismatch
switches the fast encoder off (``LocalTokenizer.distrust``) and is logged as an error.
Results go to ``kvatlas_router_tokenize_verified_total``.

Must not: tokenize for routing (``tokens``), or block the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.tokens import LocalTokenizer

log = logging.getLogger(__name__)


class EncoderChecks:
    """Samples prompts for a check (see the module doc); on the router's event loop."""

    def __init__(
        self, tokenizer: LocalTokenizer | None, every: int, metrics: RouterMetrics
    ) -> None:
        self._tokenizer = tokenizer
        self._every = every
        self._metrics = metrics
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="kvatlas-router-verify")
            if tokenizer is not None and every
            else None
        )
        self._turn = 0
        self.running = False
        """Whether a check is on its thread now."""

    def maybe_check(self, body: bytes, blob: bytes) -> None:
        """Every ``every``-th prompt, unless a check runs: its ids (``blob``) encoded
        again by the tokenizer's own encoder, off the request's path."""
        tokenizer = self._tokenizer
        if self._pool is None or tokenizer is None or self.running:
            return
        self._turn += 1
        if self._turn % self._every:
            return
        self.running = True
        work = asyncio.get_running_loop().run_in_executor(self._pool, tokenizer.verify, body, blob)
        work.add_done_callback(lambda done: self._checked(tokenizer, len(body), done))

    def _checked(
        self, tokenizer: LocalTokenizer, size: int, done: asyncio.Future[bool | None]
    ) -> None:
        self.running = False
        if done.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            log.warning("router: checking the fast encoder failed: %r", exc)
            return
        same = done.result()
        if same is None:
            return
        self._metrics.verified.labels("same" if same else "different").inc()
        if not same:
            log.error(
                "router: the fast encoder gave other ids than the tokenizer's own for a"
                " prompt of %d bytes: switching it off (every prompt from now on is encoded"
                " by the tokenizer's own encoder, on its thread)",
                size,
            )
            tokenizer.distrust("other ids than the tokenizer's own on a live prompt")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
