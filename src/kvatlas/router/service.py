"""The router's request path and its background loops, on one event loop.

Owns, for ``kvatlas router``:

- one request end to end: the prompt's token ids (a completion's token-id prompt as it
  is; else, with ``--tokenizer``, from the model's own tokenizer and chat template in
  this process: on this loop where a fast encoder makes it cheap and the tokenizer's
  thread is idle, else on that worker thread; one prompt in
  ``tokenizer_verify_every`` encoded again by the tokenizer's own encoder on a third
  thread after routing, a mismatch switching the fast encoder off; else from an
  engine's ``/tokenize``,
  given the client's body as it is, so the engine applies its own chat template and
  tokenizer), one coordinator
  lookup that answers every instance's cached prefix of those tokens (the coordinator
  hashes them with the fleet's contract; asked from this loop through ``AsyncLookups``:
  the tokens' uint32 bytes as msgpack on a keep-alive connection), the prefixes it sent
  to engines moments ago
  that the coordinator cannot know yet (``pending``), the choice (``policy.Chooser``),
  and the
  proxying: the client's body and headers (``Authorization`` and the request id
  included) to the chosen engine, its answer back byte for byte (a stream as it comes,
  any other answer once it is whole);
- failure handling: an attempt that is refused, times out, answers 5xx or breaks off
  before anything of its answer went to the client is retried on the next engine of
  the ranking (a refused connection marks the engine down at once). Nothing goes to the
  client before a stream's first piece (its first event), or the whole of any other
  answer, is in, so a stream whose engine stops before its first event, or an answer
  cut short, is retried as invisibly as a refused connection. Failures in a row open
  the engine's breaker; a failed tokenize or lookup routes this request by load
  (``least-loaded``) instead of failing. A failed lookup also takes the coordinator out
  (its breaker): the lookups waiting on it end at once (``tripwires``), and no request
  asks it again until, after ``coordinator_backoff_s``, one lookup in the background (a
  trial: no request waits on it) finds it answering; so a coordinator that is down or
  frozen (its sockets accept, nothing answers) costs the requests in flight when it
  stopped at most one ``lookup_timeout_s``, and the rest nothing. A stream broken off
  after its first piece ends with an error event. An engine that stops answering its
  probe (frozen: its sockets stay open, nothing comes) ends, through ``tripwires``,
  every await on it: requests none of whose answer went to the client yet are retried
  on their next choice (also when its breaker opens), its streams end with the error
  event; so does an engine whose probe answers but that shows no progress (no byte of
  an answer, no token counter moving) while requests wait on it, for longer than its
  first-byte deadline (learned from its waits for a first byte, ``firstbyte``); the
  load accounting of a relay ends exactly once however it ends;
- the loops: the coordinator's listing every ``refresh_interval_s`` (each cache server
  advertises its engines' URLs as ``engine_urls``), and a probe of every engine's
  ``/metrics`` every ``health_interval_s`` (health, its count of running requests, and
  the counters its prefill rate and its cache server's P2P read rate come from, which
  price a peer-held token for ``kv-p2p``).

The decision goes out in the ``X-Kvatlas-Route`` header, to the debug log and to the
metrics, and each step of the routing (tokenize, hash, lookup and the coordinator's own
part of it, pick, and the collector's pauses inside) to its histogram. Must not: parse
or rewrite what an engine answers (beyond the error event of a broken stream), read
configuration, or block the loop (the listing goes through ``CoordinatorClient`` on a
worker thread, the lookup through its ``AsyncLookups`` on the loop).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, Protocol

import httpx
import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvatlas.core.errors import InvalidInput, ServiceError
from kvatlas.router.config import RouterConfig
from kvatlas.router.device_lookup import DeviceLookups  # tiers: device lookup
from kvatlas.router.engines import EngineState, EngineTable
from kvatlas.router.firstbyte import PROGRESS_METRICS, overdue
from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.pending import PendingPrefixes
from kvatlas.router.policy import KV_POLICIES, Candidate, Choice, Chooser, Decision, Policy
from kvatlas.router.tiers import DeviceHit, Tier, TierView  # tiers: scoring by tier
from kvatlas.router.tripwires import COORDINATOR, Kind, Tripped, Tripwires
from kvatlas.runtime.coordinator_client import CoordinatorClient, CoordinatorError
from kvatlas.runtime.gc_pauses import GcPauses
from kvatlas.wire.fleet_view import ENGINE_URLS_KEY

log = logging.getLogger(__name__)

KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle connection to an engine stays pooled: below the engines' own
keep-alive timeout, so the engine never closes one the router is about to reuse."""

ROUTE_HEADER: Final = "x-kvatlas-route"
"""The answer's header naming the engine, the cached tokens expected, the tier they come
from (``tiers``), the reason, and the router's own time for this request (tokenize +
lookup + pick)."""
REQUEST_ID_HEADER: Final = "x-request-id"
_HOP_BY_HOP: Final = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "host", "content-length",
    }
)  # fmt: skip
_RUNNING_METRICS: Final = ("kvatlas_engine_requests_running", "vllm:num_requests_running")
_PREFILL_METRICS: Final = (
    "kvatlas_engine_prefilled_tokens_total",
    "kvatlas_engine_prefill_seconds_total",
)
"""(tokens, seconds) counters of an engine's prefill: its measured prefill rate."""
_P2P_METRICS: Final = (
    "kvatlas_engine_peer_cached_tokens_total",
    "kvatlas_engine_peer_fetch_seconds_total",
)
"""(tokens, seconds) counters of the P2P reads an engine's cache server made for it."""
_PROBED: Final = frozenset((*_RUNNING_METRICS, *_PREFILL_METRICS, *_P2P_METRICS, *PROGRESS_METRICS))
_JSON: Final = "application/json"
_BYTES_PER_TOKEN_GUESS: Final = 4
"""Without a tokenize (policies that need no prefix), prompt tokens are guessed from
the body's length: only the load accounting uses them."""


class _TokenizeAnswer(msgspec.Struct):
    tokens: list[int]


class _TokenIdsPrompt(msgspec.Struct):
    """A completion whose prompt is token ids already: no tokenize needed."""

    prompt: list[int]


_tokenize_answer: Final = msgspec.json.Decoder(_TokenizeAnswer)
_token_ids_prompt: Final = msgspec.json.Decoder(_TokenIdsPrompt)


def _error_body(message: str, kind: str) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": kind}})


class LocalTokenizer(Protocol):
    """The model's tokenizer and chat template in the router's process (``--tokenizer``;
    ``kvatlas.cli.router`` builds one from the engine's loader, which this package may
    not import): a chat or completion body -> the prompt's ids as the engine prefills
    them. Called from one thread at a time."""

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
        """Pay here, on the calling thread, what its first encode would (fastokens
        readies per-thread state: 15-25 ms here), not in a request's time."""
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


def _uint32(ids: list[int]) -> bytes:
    """Token ids as the little-endian uint32 bytes the router keys and looks up by."""
    return np.asarray(ids, dtype="<u4").tobytes()


@dataclass(frozen=True, slots=True)
class Plan:
    """One request's routing: the ranking, its reason, and where the time went."""

    decision: Decision
    policy: Policy
    prompt_tokens: int
    overhead_s: float
    blob: bytes = b""
    """The prompt's token ids as LE uint32 (empty when not tokenized)."""
    tiers: Mapping[str, Tier] | None = None  # tiers: engine URL -> the tier it wins by


@dataclass(frozen=True, slots=True)
class _Head:
    """What an attempt read of its answer before the client is sent anything."""

    resp: httpx.Response
    first: bytes
    """A stream's first piece; any other answer's whole body (raw, as it came)."""
    rest: AsyncIterator[bytes] | None
    """The answer's pieces after ``first``; None for a whole body."""
    stream: bool
    """An event stream (one broken off ends with an error event; any other answer cut
    short closes the client's connection before its promised length)."""


class RouterService:
    """The request path and the loops (see the module doc); one per router process."""

    def __init__(
        self,
        config: RouterConfig,
        coordinator: CoordinatorClient | None,
        *,
        tokenizer: LocalTokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._coordinator = coordinator
        self._lookups = coordinator.async_lookups() if coordinator is not None else None
        self.tokenizer = tokenizer
        # one thread: a tokenizer must not be used from two threads at once, and the
        # event loop must not wait on one
        self._tokenize_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="kvatlas-router-tokenize")
            if tokenizer is not None
            else None
        )
        # a thread of its own: a check of the fast encoder (tokenizers' speed) must not
        # queue the next prompts behind it
        self._verify_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="kvatlas-router-verify")
            if tokenizer is not None and config.tokenizer_verify_every
            else None
        )
        self._verify_turn = 0
        self._verifying = False
        self._clock = clock
        self.table = EngineTable()
        for e in config.engines:
            self.table.add_static(e.url, e.instance_id)
        self.chooser = Chooser(config.policy, config.weights, random.Random(config.seed))
        self.pending = PendingPrefixes(config.chunk_size, config.pending_ttl_s)
        self.gc = GcPauses()
        self.metrics = RouterMetrics(
            self.table,
            config.weights.p2p,
            self.gc,
            lambda w: w.deadline_s(
                config.first_byte_floor_s, config.first_byte_factor, config.first_byte_timeout_s
            ),
        )
        if tokenizer is not None:
            self.metrics.watch_tokenize_cache(tokenizer.cache_stats)
        self.wires = Tripwires()
        self.metrics.coordinator_available.set(1 if coordinator is not None else 0)
        self.device = DeviceLookups(  # tiers: device lookup
            coordinator.urls if coordinator is not None else (), auth_token=config.auth_token,
            timeout_s=config.lookup_timeout_s, registry=self.metrics.registry,
            backoff_s=config.coordinator_backoff_s,
        )  # fmt: skip
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._coordinator_down_until = 0.0
        """0 while the coordinator answers; else when to try it again (its breaker)."""
        self._coordinator_trial: asyncio.Task[None] | None = None
        self._tokenize_turn = 0
        self._tokenize_busy = 0
        """Calls on the tokenizer's thread not yet finished (queued or running)."""
        self._tasks: list[asyncio.Task[None]] = []
        self.routed = 0
        self.failed = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """The tokenizer readied on both threads that call it, one listing and one round
        of probes, then the loops."""
        self.gc.install()
        if self.tokenizer is not None and self._tokenize_pool is not None:
            self.tokenizer.warm()
            await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, self.tokenizer.warm
            )
        await self.refresh()
        await self.probe_all()
        self._tasks = [
            asyncio.create_task(self._every(self.config.refresh_interval_s, self.refresh)),
            asyncio.create_task(self._every(self.config.health_interval_s, self.probe_all)),
        ]

    async def close(self) -> None:
        tasks = list(self._tasks)
        if self._coordinator_trial is not None:
            tasks.append(self._coordinator_trial)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()
        if self._lookups is not None:
            await self._lookups.aclose()
        await self.device.aclose()  # tiers: device lookup
        self.gc.remove()
        for pool in (self._tokenize_pool, self._verify_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    async def _every(self, interval: float, step: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await step()  # type: ignore[misc]
            except Exception:
                log.exception("router loop step %s failed", getattr(step, "__name__", step))

    def _client(self, url: str) -> httpx.AsyncClient:
        """One keep-alive pool per engine. Its idle connections expire before an
        engine's own keep-alive timeout (uvicorn's and vLLM's: 5 s) would close them, so
        a request is not sent on a connection the engine is closing."""
        client = self._clients.get(url)
        if client is None:
            c = self.config
            timeout = httpx.Timeout(c.first_byte_timeout_s, connect=c.connect_timeout_s)
            limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
            client = httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)
            self._clients[url] = client
        return client

    # ------------------------------------------------------------------ discovery, health

    async def refresh(self) -> None:
        """Apply the coordinator's listing (nothing to do without a coordinator)."""
        if self._coordinator is None:
            return
        try:
            instances = await asyncio.to_thread(self._coordinator.instances)
        except CoordinatorError as exc:
            log.warning("router: cannot list the coordinator's instances: %s", exc)
            return
        models: dict[str, str] = {}
        listing: list[tuple[str, str, str]] = []
        for inst in instances:
            declared = inst.metadata.get("models", "")
            model = self.config.model_name or (declared if "," not in declared else "")
            models[inst.instance_id] = model
            for url in filter(None, inst.metadata.get(ENGINE_URLS_KEY, "").split(",")):
                listing.append((url.rstrip("/"), inst.instance_id, model))
        added, dropped = self.table.update_listing(listing, models)
        for url in added:
            log.info(
                "router: engine %s of instance %s joined", url, self.table.engines[url].instance_id
            )
        for url in dropped:
            log.info("router: engine %s left the listing", url)
            self.wires.forget(url)
            client = self._clients.pop(url, None)
            if client is not None:
                await client.aclose()
        if added:
            await asyncio.gather(*(self.probe(self.table.engines[u]) for u in added))

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in list(self.table.engines.values())))
        self._first_byte_deadlines()

    def _first_byte_deadlines(self) -> None:
        """Take out the engines that requests wait on and that have shown no progress
        for longer than their first-byte deadline (``firstbyte``), probe or not."""
        c, now, wires = self.config, self._clock(), self.wires
        waits = ((e.url, e.watch, wires.armed(e.url, "first_byte") + wires.armed(e.url, "stream"))
                 for e in self.table.engines.values())  # fmt: skip
        deadline = (c.first_byte_floor_s, c.first_byte_factor, c.first_byte_timeout_s)
        for late in overdue(waits, now, *deadline):
            e = self.table.engines[late.url]
            e.stalled(late.silent_s, late.deadline_s, now, c.breaker_open_s)
            self.metrics.first_byte_deadlines.labels(e.url).inc()
            self.metrics.breaker_opens.labels(e.url).inc()
            log.warning("router: engine %s is out for %.1f s: %s", e.url, c.breaker_open_s,
                        e.last_error)  # fmt: skip
            self._fail_over(e, "stalled", streams=True)

    async def probe(self, e: EngineState) -> None:
        """``GET /metrics``: a 200 is healthy; its count of running requests is load. No
        answer in ``probe_timeout_s`` (cause ``frozen``) or a refused connection (``down``)
        also ends every await on the engine (``_fail_over``)."""
        was = e.available(self._clock())
        cause = ""
        timeout = self.config.probe_timeout_s
        try:
            resp = await self._client(e.url).get("/metrics", timeout=timeout)
            ok, reason = resp.status_code == 200, f"/metrics answered {resp.status_code}"
            samples = _samples(resp.text) if ok else {}
        except httpx.TimeoutException:
            ok, samples, cause = False, {}, "frozen"
            reason = f"/metrics failed: no answer in {timeout:g} s (frozen?)"
        except httpx.HTTPError as exc:
            # nothing listens: down. A connection broken otherwise (a keep-alive one the
            # engine closed as it was reused) takes it out until the next probe, but is
            # no proof that its requests are lost
            ok, reason, samples = False, f"/metrics failed: {exc!r}", {}
            cause = "down" if isinstance(exc, httpx.ConnectError) else ""
        running = next((int(samples[m]) for m in _RUNNING_METRICS if m in samples), 0)
        e.probed(ok, running, reason, self._clock())
        e.watch.probed(samples, self._clock())
        if cause:
            self._fail_over(e, cause, streams=True)
        for meter, (tokens, seconds) in ((e.prefill, _PREFILL_METRICS), (e.p2p, _P2P_METRICS)):
            if tokens in samples and seconds in samples:
                meter.sample(samples[tokens], samples[seconds])
        now = e.available(self._clock())
        if now != was:
            if now:
                log.info("router: engine %s (instance %s) is available", e.url, e.instance_id)
            else:
                log.warning("router: engine %s is unavailable: %s", e.url, e.last_error)

    def _fail_over(self, e: EngineState, cause: str, *, streams: bool) -> None:
        """End the awaits on ``e`` (it is out already): those for a first byte are retried
        elsewhere by their requests, and with ``streams`` its streams end with an error."""
        kinds: tuple[Kind, ...] = ("first_byte", "stream") if streams else ("first_byte",)
        n = self.wires.trip(e.url, cause, kinds)
        if n:
            log.warning(
                "router: engine %s is out (%s): ending %d request(s) waiting on it or"
                " streaming from it",
                e.url, cause, n,
            )  # fmt: skip

    # ------------------------------------------------------------------ routing

    async def plan(self, body: bytes, endpoint: str = "/v1/chat/completions") -> Plan:
        """Tokenize, look up and rank; ServiceError when no engine is available."""
        t0 = time.perf_counter()
        gc0 = self.gc.total
        engines = self.table.available(self._clock())
        if not engines:
            raise ServiceError("no engine is available")
        policy: Policy = self.config.policy
        tokenized_here = False
        prompt = 0
        pending: dict[str, int] = {}
        holders: list[tuple[str, str, int]] | None = None  # tiers: chunk lookup's holders
        hits: list[DeviceHit] = []  # tiers: device lookup's hits
        blob: bytes | None = None
        if policy in KV_POLICIES:
            t_hash = time.perf_counter()
            blob = _prompt_blob(body) if endpoint == "/v1/completions" else None
            if blob is None:
                blob = await self._tokenize(engines, body)
                t_hash = time.perf_counter()
                tokenized_here = blob is not None and self.tokenizer is not None
            if blob is not None:
                pending = self.pending.leading(blob, self._clock())
                self.metrics.observe("hash", time.perf_counter() - t_hash)
            holders, hits = (  # tiers: the device lookup runs beside the chunk lookup
                (None, []) if blob is None
                else await self.device.beside(self._lookup(blob), blob)
            )  # fmt: skip
            if holders is None and not hits:  # tiers: the device tier alone can route
                policy = "least-loaded"
            else:
                assert blob is not None
                prompt = len(blob) // 4
                self.metrics.prompt_tokens.inc(prompt)
        view = TierView(holders or (), hits, pending)  # tiers: scoring by tier
        fleet = view.fleet
        if not prompt:
            prompt = len(body) // _BYTES_PER_TOKEN_GUESS
        t_pick = time.perf_counter()
        candidates = [
            Candidate(
                e.url,
                e.load,
                e.queued_tokens,
                view.local(e.url, e.instance_id),  # tiers: scoring by tier
                self.table.p2p_weight(e),
            )
            for e in engines
        ]
        decision = self.chooser.rank(candidates, prompt, fleet, policy=policy)
        if policy != self.config.policy:
            decision = Decision(decision.ranked, f"{policy}: lookup unavailable")
        end = time.perf_counter()
        self.metrics.observe("pick", end - t_pick)
        self.metrics.observe("overhead_gc", self.gc.total - gc0)
        if tokenized_here and self.tokenizer is not None and blob is not None:
            # after the choice: the check's CPU does not delay this request's lookup
            self._maybe_verify(self.tokenizer, body, blob)
        tiers = view.tiers(  # tiers: the tier each ranked engine wins by
            (c.name, self.table.engines[c.name].instance_id, c.cached_tokens)
            for c in decision.ranked
        )
        return Plan(decision, policy, prompt, end - t0, blob or b"", tiers)

    async def _tokenize(self, engines: list[EngineState], body: bytes) -> bytes | None:
        """The prompt's ids as uint32 bytes, here (``--tokenizer``, on the tokenizer's
        thread, which also packs them, through its piece cache where it keeps one) or
        from an engine's ``/tokenize``; None when that fails (the request is then routed
        by load, and its engine answers the error)."""
        if self._tokenize_pool is None:
            return await self._tokenize_on_engine(engines, body)
        tokenizer = self.tokenizer
        assert tokenizer is not None
        t0 = time.perf_counter()
        try:
            # Inline when it is cheap and the thread is idle (so the tokenizer is never
            # used from two threads at once): the hand-off to a thread and back costs
            # 0.2-0.6 ms here, more than a fast encoder takes for a 4k-token prompt.
            if not self._tokenize_busy and tokenizer.inline_ok(body):
                ids = tokenizer.blob(body)
                self.metrics.tokenized.labels("inline").inc()
            else:
                ids = await self._tokenize_on_thread(tokenizer, body)
                self.metrics.tokenized.labels("thread").inc()
        except (InvalidInput, TimeoutError, OverflowError) as exc:
            log.debug("router: cannot tokenize the prompt here: %r", exc)
            self.metrics.degraded.labels("tokenize").inc()
            return None
        self.metrics.observe("tokenize", time.perf_counter() - t0)
        return ids

    def _maybe_verify(self, tokenizer: LocalTokenizer, body: bytes, blob: bytes) -> None:
        """Every ``tokenizer_verify_every``-th prompt, unless a check runs: its ids
        encoded again by the tokenizer's own encoder, off the request's path."""
        if self._verify_pool is None or self._verifying:
            return
        self._verify_turn += 1
        if self._verify_turn % self.config.tokenizer_verify_every:
            return
        self._verifying = True
        work = asyncio.get_running_loop().run_in_executor(
            self._verify_pool, tokenizer.verify, body, blob
        )
        work.add_done_callback(lambda done: self._verified(tokenizer, len(body), done))

    def _verified(
        self, tokenizer: LocalTokenizer, size: int, done: asyncio.Future[bool | None]
    ) -> None:
        self._verifying = False
        if done.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            log.warning("router: checking the fast encoder failed: %r", exc)
            return
        same = done.result()
        if same is None:
            return
        self.metrics.verified.labels("same" if same else "different").inc()
        if not same:
            log.error(
                "router: the fast encoder gave other ids than the tokenizer's own for a"
                " prompt of %d bytes: switching it off (every prompt from now on is encoded"
                " by the tokenizer's own encoder, on its thread)",
                size,
            )
            tokenizer.distrust("other ids than the tokenizer's own on a live prompt")

    async def _tokenize_on_thread(self, tokenizer: LocalTokenizer, body: bytes) -> bytes:
        """``tokenizer.blob(body)`` on the tokenizer's thread (TimeoutError past the
        lookup deadline: the call itself runs on, and counts as busy until it ends)."""
        assert self._tokenize_pool is not None
        work = asyncio.get_running_loop().run_in_executor(self._tokenize_pool, tokenizer.blob, body)
        self._tokenize_busy += 1
        work.add_done_callback(self._tokenize_done)
        return await asyncio.wait_for(asyncio.shield(work), self.config.lookup_timeout_s)

    def _tokenize_done(self, _: object) -> None:
        self._tokenize_busy -= 1

    async def _tokenize_on_engine(self, engines: list[EngineState], body: bytes) -> bytes | None:
        """The prompt's ids from one engine's ``/tokenize`` (engines in turn)."""
        self._tokenize_turn += 1
        e = engines[self._tokenize_turn % len(engines)]
        t0 = time.perf_counter()
        try:
            resp = await self._client(e.url).post(
                "/tokenize",
                content=body,
                headers={"content-type": _JSON},
                timeout=self.config.lookup_timeout_s,
            )
            if resp.status_code != 200:
                self.metrics.degraded.labels("tokenize").inc()
                return None
            ids = _uint32(_tokenize_answer.decode(resp.content).tokens)
        except (httpx.HTTPError, msgspec.DecodeError, OverflowError) as exc:
            log.debug("router: /tokenize on %s failed: %r", e.url, exc)
            self.metrics.degraded.labels("tokenize").inc()
            return None
        self.metrics.observe("tokenize", time.perf_counter() - t0)
        return ids

    async def _lookup(self, blob: bytes) -> list[tuple[str, str, int]] | None:
        """(instance, tier, leading tokens held) for every holder of the prompt's prefix; None
        without a coordinator, a model name, or an answer in time, and while the
        coordinator is out (see the module doc)."""
        model = self.config.model_name or self.table.model_name()
        if self._lookups is None or not model or not self._coordinator_in(blob, model):
            self.metrics.degraded.labels("lookup").inc()
            return None
        t0 = time.perf_counter()
        try:
            async with self.wires.arm(COORDINATOR, "lookup"):
                answer = await self._lookups.holders(
                    blob, model, timeout_s=self.config.lookup_timeout_s
                )
        except Tripped:  # another lookup found the coordinator out
            self.metrics.degraded.labels("lookup").inc()
            return None
        except CoordinatorError as exc:
            self._coordinator_out(exc)
            self.metrics.degraded.labels("lookup").inc()
            return None
        self.metrics.observe("lookup", time.perf_counter() - t0)
        if answer.server_s is not None:
            self.metrics.observe("lookup_server", answer.server_s)
        return [(h.instance_id, h.tier, h.tokens) for h in answer.holders]  # tiers: with tier

    def _coordinator_in(self, blob: bytes, model: str) -> bool:
        """Whether a request may ask the coordinator now: yes while it answers; while it
        is out, no, and once its backoff is over this request's lookup is sent as the
        trial, in the background (the request routes by load)."""
        if not self._coordinator_down_until:
            return True
        if self._coordinator_trial is None and self._clock() >= self._coordinator_down_until:
            self._coordinator_trial = asyncio.create_task(self._try_coordinator(blob, model))
        return False

    def _coordinator_out(self, exc: CoordinatorError) -> None:
        """A lookup failed: the coordinator is out for ``coordinator_backoff_s``, and the
        lookups waiting on it end now."""
        backoff = self.config.coordinator_backoff_s
        was_in = not self._coordinator_down_until
        self._coordinator_down_until = self._clock() + backoff
        self.metrics.coordinator_available.set(0)
        n = self.wires.trip(COORDINATOR, "out", ("lookup",))
        if was_in:
            log.warning(
                "router: coordinator lookup failed, routing by load (trying it again every"
                " %.1f s, in the background; %d other lookup(s) ended): %s",
                backoff, n, exc,
            )  # fmt: skip

    async def _try_coordinator(self, blob: bytes, model: str) -> None:
        """The trial lookup of a coordinator that is out: back in when it answers."""
        assert self._lookups is not None
        try:
            await self._lookups.holders(blob, model, timeout_s=self.config.lookup_timeout_s)
        except CoordinatorError as exc:
            self._coordinator_down_until = self._clock() + self.config.coordinator_backoff_s
            log.debug("router: the coordinator is still out: %s", exc)
        else:
            self._coordinator_down_until = 0.0
            self.metrics.coordinator_available.set(1)
            log.info("router: the coordinator answers again: routing by %s", self.config.policy)
        finally:
            self._coordinator_trial = None

    # ------------------------------------------------------------------ proxying

    async def forward(self, request: Request) -> Response:
        """Route one request and relay the chosen engine's answer."""
        endpoint = request.url.path
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        rid = headers.setdefault(REQUEST_ID_HEADER, uuid.uuid4().hex)
        try:
            if request.method == "POST":
                plan = await self.plan(body, endpoint)
            else:
                plan = self._any_engine()
        except ServiceError as exc:
            return self._refuse(endpoint, 503, str(exc), "service_unavailable")
        if request.method == "POST":
            self.metrics.observe("overhead", plan.overhead_s)
        attempts: list[str] = []
        for choice in plan.decision.ranked:
            if len(attempts) >= self.config.max_attempts:
                break
            e = self.table.engines.get(choice.name)
            if e is None or not e.available(self._clock()):
                continue
            attempts.append(e.url)
            if plan.blob:
                # before the engine answers: the next request for this prefix may arrive
                # while this one still queues or prefills (see ``PendingPrefixes``)
                self.pending.note(plan.blob, e.url, self._clock())
            head = await self._attempt(
                e, choice, method=request.method, endpoint=endpoint, body=body, headers=headers
            )
            if head is None:
                if plan.blob:
                    self.pending.forget(plan.blob, e.url)
                continue
            return self._relay(
                e, choice, plan, head, endpoint=endpoint, rid=rid, attempt=len(attempts)
            )
        self.failed += 1
        return self._refuse(
            endpoint,
            502,
            f"no engine answered (tried {', '.join(attempts) or 'none'})",
            "bad_gateway",
        )

    def _any_engine(self) -> Plan:
        engines = self.table.available(self._clock())
        if not engines:
            raise ServiceError("no engine is available")
        cands = [Candidate(e.url, e.load, e.queued_tokens) for e in engines]
        decision = self.chooser.rank(cands, 0, 0, policy="least-loaded")
        return Plan(decision, "least-loaded", 0, 0.0)

    async def _attempt(
        self,
        e: EngineState,
        choice: Choice,
        *,
        method: str,
        endpoint: str,
        body: bytes,
        headers: dict[str, str],
    ) -> _Head | None:
        """Send to one engine and read its answer's head (``_Head``); None after a
        failure before anything of it could go to the client, counted against the
        engine (one that ended because the engine is out, ``Tripped``, is not: the fault
        is counted once, by whoever found it)."""
        client = self._client(e.url)
        rid = headers[REQUEST_ID_HEADER]
        e.begin(choice.prefill_tokens, sent := self._clock())
        resp: httpx.Response | None = None
        cause = ""
        try:
            req = client.build_request(method, endpoint, content=body, headers=headers)
            async with self.wires.arm(e.url, "first_byte"):
                resp = await client.send(req, stream=True)
                if resp.status_code < 500:
                    head = await _read_head(resp, self.config.max_held_answer_bytes)
        except Tripped as exc:
            await self._abandon(e, choice, resp)
            self.metrics.retries.labels(e.url, exc.cause).inc()
            log.warning(
                "router: request %s: engine %s is out (%s) before its answer began: the"
                " request goes to its next choice",
                rid, e.url, exc.cause,
            )  # fmt: skip
            return None
        except httpx.ConnectError as exc:
            cause, detail = "refused", repr(exc)
            e.healthy = False  # nothing listens: down until a probe says otherwise
        except httpx.TimeoutException as exc:
            cause, detail = "timeout", repr(exc)
        except httpx.HTTPError as exc:
            cause, detail = "broken", repr(exc)
        except BaseException:  # cancelled (the router stops): the accounting stays right
            await self._abandon(e, choice, resp)
            raise
        else:
            assert resp is not None
            e.watch.first_byte(self._clock() - sent, self._clock())
            if resp.status_code < 500:
                e.succeeded()
                return head
            cause, detail = "5xx", f"answered {resp.status_code}"
        await self._abandon(e, choice, resp)
        self.metrics.retries.labels(e.url, cause).inc()
        if e.failed(
            detail, self._clock(), self.config.breaker_failures, self.config.breaker_open_s
        ):
            self.metrics.breaker_opens.labels(e.url).inc()
            log.warning("router: breaker of engine %s opened after %d failures", e.url, e.failures)
            self._fail_over(e, "breaker", streams=False)
        log.warning(
            "router: request %s: engine %s failed before its answer began (%s: %s): the"
            " request goes to its next choice",
            rid, e.url, cause, detail,
        )  # fmt: skip
        return None

    async def _abandon(self, e: EngineState, choice: Choice, resp: httpx.Response | None) -> None:
        """End an attempt that will not be relayed: its accounting, and its answer's
        connection (nothing more of that answer will be read)."""
        e.end(choice.prefill_tokens, self._clock())
        if resp is not None:
            await resp.aclose()

    def _relay(
        self,
        e: EngineState,
        choice: Choice,
        plan: Plan,
        head: _Head,
        *,
        endpoint: str,
        rid: str,
        attempt: int,
    ) -> Response:
        resp = head.resp
        reason = plan.decision.reason if attempt == 1 else f"{plan.decision.reason}; retry"
        tier = (plan.tiers or {}).get(e.url, "none")  # tiers: named in the header
        route = (
            f"engine={e.url}; cached={choice.cached_tokens}; tier={tier}; reason={reason};"
            f" overhead_ms={plan.overhead_s * 1000:.3f}"
        )
        if endpoint != "/v1/models":
            self.routed += 1
            self.metrics.decisions.labels(plan.policy, reason, e.url).inc()
            self.metrics.expected_cached.inc(choice.cached_tokens)
            self.device.count_tier(tier)  # tiers: decisions by tier
            log.debug(
                "router: request %s -> %s (prompt %d tokens, %d expected cached, %s,"
                " overhead %.2f ms)",
                rid, e.url, plan.prompt_tokens, choice.cached_tokens, reason,
                plan.overhead_s * 1000,
            )  # fmt: skip
        self.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}
        if head.rest is not None and not head.stream and "content-length" in resp.headers:
            headers["content-length"] = resp.headers["content-length"]  # relayed as it comes
        headers[ROUTE_HEADER] = route
        headers.setdefault(REQUEST_ID_HEADER, rid)
        ended = False

        async def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                e.end(choice.prefill_tokens, self._clock())
                await resp.aclose()

        if head.rest is None:  # whole (its length is the body's): done with the engine
            return _Whole(head.first, end, status_code=resp.status_code, headers=headers)
        return _Relayed(
            self._pieces(e, head, rid, end),
            end,
            status_code=resp.status_code,
            headers=headers,
        )

    async def _pieces(
        self, e: EngineState, head: _Head, rid: str, end: Callable[[], Awaitable[None]]
    ) -> AsyncIterator[bytes]:
        """An answer's pieces as they come: a stream broken off ends with an error event;
        any other answer (one past ``max_held_answer_bytes``) ends cut (``_CutShort``)."""
        rest = head.rest
        assert rest is not None
        try:
            if head.first:
                yield head.first
            while True:
                # armed around the await only: a trip never lands on the client's send
                async with self.wires.arm(e.url, "stream"):
                    try:
                        piece = await anext(rest)
                    except StopAsyncIteration:
                        break
                e.watch.piece(self._clock())
                yield piece
        except Tripped as exc:
            self.metrics.stream_failures.labels(e.url, exc.cause).inc()
            message = f"the engine {e.url} stopped answering ({exc.cause}); this answer is cut"
            log.warning("router: request %s: %s (%s)", rid, message, _ENDING[head.stream])
            if not head.stream:
                raise _CutShort from exc
            yield b"data: " + _error_body(message, "upstream_error") + b"\n\n"
        except httpx.HTTPError as exc:
            self.metrics.stream_failures.labels(e.url, "broken").inc()
            e.failed(repr(exc), self._clock(), self.config.breaker_failures, 0.0)
            message = f"the engine {e.url} broke off this answer: {exc!r}"
            log.warning("router: request %s: %s (%s)", rid, message, _ENDING[head.stream])
            if not head.stream:
                raise _CutShort from exc
            yield b"data: " + _error_body(message, "upstream_error") + b"\n\n"
        finally:
            await end()

    def _refuse(self, endpoint: str, code: int, message: str, kind: str) -> Response:
        self.metrics.requests.labels(endpoint, str(code)).inc()
        return Response(_error_body(message, kind), status_code=code, media_type=_JSON)


class _Whole(Response):
    """An answer read whole; ``end`` (idempotent) ends its accounting once it is sent,
    or the client left."""

    def __init__(
        self,
        body: bytes,
        end: Callable[[], Awaitable[None]],
        *,
        status_code: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(body, status_code=status_code, headers=headers)
        self._end = end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._end()


_ENDING: Final = {
    True: "the stream ends with an error event",
    False: "the client's connection closes before the answer's length",
}


class _CutShort(Exception):
    """A relayed answer that is not a stream was broken off (logged where it was found):
    the client's connection closes without the rest of it."""


class _Relayed(StreamingResponse):
    """An engine's answer on its way to the client; ``end`` (idempotent) closes it and
    ends its accounting however the relay ends, also when the client left before the
    body began (the pieces' generator then never runs, nor its ``finally``)."""

    def __init__(
        self,
        pieces: AsyncIterator[bytes],
        end: Callable[[], Awaitable[None]],
        *,
        status_code: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(pieces, status_code=status_code, headers=headers)
        self._end = end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except _CutShort:
            pass  # the body ends unfinished: the HTTP server closes the connection
        finally:
            await self._end()


async def _read_head(resp: httpx.Response, hold: int) -> _Head:
    """A stream's (``text/event-stream``) first piece; any other answer whole, or its
    first ``hold`` bytes or more and the rest of its pieces when it is longer."""
    pieces = resp.aiter_raw()
    if "text/event-stream" in resp.headers.get("content-type", ""):
        return _Head(resp, await anext(pieces, b""), pieces, stream=True)
    held: list[bytes] = []
    size = 0
    async for piece in pieces:
        held.append(piece)
        size += len(piece)
        if size >= hold:
            return _Head(resp, b"".join(held), pieces, stream=False)
    return _Head(resp, b"".join(held), None, stream=False)


def _prompt_blob(body: bytes) -> bytes | None:
    """A completion's prompt when it is token ids (the engine prefills exactly those), as
    uint32 bytes; None for any other body (one with an id outside uint32 too)."""
    try:
        return _uint32(_token_ids_prompt.decode(body).prompt)
    except (msgspec.DecodeError, msgspec.ValidationError, OverflowError):
        return None


def _samples(text: str) -> dict[str, float]:
    """The metrics the probe reads (``_PROBED``) from an engine's Prometheus text, the
    first sample of each (vLLM labels its gauges with the model); a malformed or absent
    one is left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        brace = line.find("{")
        space = line.find(" ")
        cut = brace if 0 <= brace < space or space < 0 <= brace else space
        name = line[:cut] if cut >= 0 else line
        if name not in _PROBED or name in out:
            continue
        rest = line[line.rfind("}") + 1 :] if cut == brace else line[cut:]
        try:
            out[name] = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
    return out
