"""The reference engine process: its composition root and its one model worker.

Owns, for ``kvatlas engine``:

- ``EngineCore``: the single worker thread every request's model work runs on (one
  request at a time through the model, which is what a CPU affords), and one request end
  to end: fetch the cached prefix from the connector, prefill the rest, decode (greedy or
  sampled, stop tokens and stop strings, cancellation), store the newly computed chunks,
  and the request's cache statistics. Tokenizing runs on that thread too, so the
  tokenizer is never used from two threads at once; ``/tokenize`` (a router's question)
  runs on a second thread with a copy of the tokenizer, so it never waits for the model.
  It keeps the model's KV storage (``kv_cache.KVArena``) across requests: one request at
  a time is what lets every request's cache live in the same, already mapped memory.
- ``EngineMetrics``: the Prometheus metrics of the engine (prefix ``kvatlas_engine_``).
- ``EngineApp``: builds and names every part (model, cache client, connector, core,
  HTTP app, uvicorn) from an ``EngineConfig``, starts them, and stops them on SIGTERM.

Must not: parse flags or read the environment (``kvatlas.cli.engine`` does), speak HTTP
(``openai_server`` does), or talk to the cache server other than through the connector.

``EngineCore`` implements ``openai_server.ModelWorker``: the HTTP edge defines what it
needs of a model worker, this module provides it.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final, TypeVar

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvatlas.connector.client import CacheClient
from kvatlas.connector.kv_connector import CachedPrefix, FetchStats, KVConnector, KVLoadFailed
from kvatlas.engine.config import EngineConfig, LoadFailurePolicy
from kvatlas.engine.generate import Decoder, Detokenizer, Sampler, prefill
from kvatlas.engine.kv_cache import KVArena
from kvatlas.engine.model import LoadedModel, Tokenizer, load_model
from kvatlas.engine.openai_server import GenOutcome, GenRequest, TextCallback, build_app
from kvatlas.runtime.asgi_thread import AsgiThread, serve_until_signal
from kvatlas.runtime.periodic import Periodic

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_WARMUP_TOKENS: Final = 64
_TTFT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_RATE_BUCKETS: Final = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
_PEER_FETCH_PARTS: Final = frozenset(
    f"p2p_{part}" for part in ("directory", "lock", "reserve", "transfer", "commit", "unlock")
)
"""The parts of ``breakdown_ms`` the cache server spent reading from peers (not its
``p2p_local_lookup``, which every request pays)."""


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back what may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.text = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Text that is safe to emit now."""
        if self.stopped:
            return ""
        self._buf += piece
        hits = [i for i in (self._buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._buf, self.stopped = self._buf[: min(hits)], "", True
        else:
            cut = max(0, len(self._buf) - self._hold)
            out, self._buf = self._buf[:cut], self._buf[cut:]
        self.text += out
        return out

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        self.text += out
        return out


class EngineMetrics:
    """The engine's Prometheus metrics, in a registry of its own."""

    def __init__(self, connector: KVConnector | None = None, arena: KVArena | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ns = "kvatlas_engine"
        self.requests = Counter(
            f"{ns}_requests", "HTTP requests by endpoint and status code", ["endpoint", "code"],
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            f"{ns}_ttft_seconds", "Arrival to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.load = Histogram(
            f"{ns}_kv_load_seconds",
            "Lookup, verification and cache build of the cached prefix",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(f"{ns}_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            f"{ns}_cached_tokens", "Prompt tokens loaded from the cache server", registry=r
        )
        self.peer_tokens = Counter(
            f"{ns}_peer_cached_tokens", "Cached prompt tokens the server read from peers",
            registry=r,
        )  # fmt: skip
        self.prefilled_tokens = Counter(
            f"{ns}_prefilled_tokens", "Prompt tokens the model computed", registry=r
        )
        self.prefill_seconds = Counter(
            f"{ns}_prefill_seconds", "Model time spent computing prefilled tokens (with"
            " prefilled_tokens: the engine's prefill rate, which a router costs against)",
            registry=r,
        )  # fmt: skip
        self.peer_fetch_seconds = Counter(
            f"{ns}_peer_fetch_seconds", "Cache-server time spent reading peer_cached_tokens"
            " from peers (directory, lock, transfer, commit, unlock): the P2P read rate",
            registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            f"{ns}_generation_tokens", "Completion tokens generated", registry=r
        )
        self.decoded_tokens = Counter(
            f"{ns}_decoded_tokens", "Completion tokens counted as each is decoded (the"
            " others count a request as it ends): a router's sign that the engine works",
            registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            f"{ns}_kv_load_fallbacks", "Requests that recomputed after a failed KV lookup/load",
            ["cause"], registry=r,
        )  # fmt: skip
        self.stored_chunks = Counter(
            f"{ns}_stored_chunks", "New chunks stored into the cache server", registry=r
        )
        self.decode_rate = Histogram(
            f"{ns}_decode_tokens_per_second", "Decode speed per request", buckets=_RATE_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.running = Gauge(f"{ns}_requests_running", "Requests in the engine", registry=r)
        if arena is not None:
            held = Gauge(
                f"{ns}_kv_arena_bytes",
                "Bytes the model's KV cache storage holds (grows to the longest request)",
                registry=r,
            )
            held.set_function(lambda: float(arena.nbytes))
        if connector is not None:
            connected = Gauge(
                f"{ns}_cache_connected", "1 while registered with the cache server", registry=r
            )
            connected.set_function(lambda: 1.0 if connector.connected else 0.0)

    def observe(self, out: GenOutcome) -> None:
        self.ttft.observe(out.ttft_s)
        self.load.observe(out.load_s)
        self.prompt_tokens.inc(out.prompt_tokens)
        self.cached_tokens.inc(out.cached_tokens)
        self.peer_tokens.inc(out.peer_cached_tokens)
        self.prefilled_tokens.inc(out.prefilled_tokens)
        if out.prefilled_tokens:
            self.prefill_seconds.inc(out.breakdown_ms.get("prefill", 0.0) / 1000)
        if out.peer_cached_tokens:
            self.peer_fetch_seconds.inc(
                sum(v for k, v in out.breakdown_ms.items() if k in _PEER_FETCH_PARTS) / 1000
            )
        self.generation_tokens.inc(out.completion_tokens)
        self.stored_chunks.inc(out.stored_chunks)
        if out.fallback is not None:
            self.fallbacks.labels(out.fallback).inc()
        if out.completion_tokens > 1 and out.decode_s > 0:
            self.decode_rate.observe((out.completion_tokens - 1) / out.decode_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCore:
    """The model worker: one request at a time, end to end (see the module doc)."""

    def __init__(
        self,
        model: LoadedModel,
        connector: KVConnector | None,
        metrics: EngineMetrics,
        *,
        chunk_size: int,
        max_model_len: int | None = None,
        load_failure_policy: LoadFailurePolicy = "recompute",
        default_max_tokens: int = 256,
        arena: KVArena | None = None,
    ) -> None:
        self.model = model
        self.connector = connector
        self.metrics = metrics
        self.chunk_size = chunk_size
        model_len = int(getattr(model.model.config, "max_position_embeddings", 0) or 0)
        self.max_model_len = max_model_len or model_len or 2048
        self.vocab_size = int(model.model.config.vocab_size)
        self.load_failure_policy = load_failure_policy
        self.default_max_tokens = default_max_tokens
        # The model's KV storage, reused by every request (one at a time, on the worker).
        self.arena = arena if arena is not None else KVArena(model.kv_spec)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvatlas-model")
        # Its own copy: a tokenizer must not be used from two threads at once.
        self._tokenizer: Tokenizer = copy.deepcopy(model.tokenizer)
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvatlas-tokenize")

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run ``fn`` on the model worker (after every request submitted before it)."""
        return self._worker.submit(fn)

    def tokenize(self, fn: Callable[[Tokenizer], _T]) -> Future[_T]:
        """Run ``fn`` with the tokenizer copy on the tokenize thread (beside the model)."""
        return self._tokenize.submit(fn, self._tokenizer)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._tokenize.shutdown(wait=True, cancel_futures=True)

    def count_request(self, endpoint: str, code: int) -> None:
        self.metrics.requests.labels(endpoint, str(code)).inc()

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def health(self) -> dict[str, object]:
        if self.connector is None:
            cache = "disabled"
        else:
            cache = "connected" if self.connector.connected else "disconnected"
        return {"status": "ok", "model": self.model.name, "cache": cache}

    # ------------------------------------------------------------------ one request

    def warmup(self) -> None:
        """One short uncached prefill, so that the first request does not pay for
        torch's lazy initialisation; also seeds the recompute estimate."""
        ids = [i % self.vocab_size for i in range(1, _WARMUP_TOKENS + 1)]
        pre = prefill(self.model, ids, None, self.chunk_size, arena=self.arena)
        if self.connector is not None:
            self.connector.observe_prefill(pre.prefilled_tokens, pre.prefill_s)
        log.info("warm-up prefill of %d tokens took %.0f ms", len(ids), pre.prefill_s * 1000)
        # the /tokenize copy's first chat template is compiled here, not in a router's
        # first request (which waits for it only --lookup-timeout-s)
        self.tokenize(lambda tok: tok.apply_chat_template([{"role": "user", "content": "hi"}]))

    def generate(
        self,
        req: GenRequest,
        on_text: TextCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> GenOutcome:
        """Serve one request on the calling thread (the worker: use ``submit``)."""
        self.metrics.running.inc()
        try:
            out = self._generate(req, on_text, cancel)
        finally:
            self.metrics.running.dec()
        self.metrics.observe(out)
        return out

    def _fetch(self, ids: Sequence[int], salt: str) -> CachedPrefix:
        if self.connector is None:
            return CachedPrefix([], FetchStats())
        return self.connector.fetch_prefix(ids, cache_salt=salt)

    @torch.inference_mode()
    def _generate(
        self, req: GenRequest, on_text: TextCallback | None, cancel: threading.Event | None
    ) -> GenOutcome:
        ids = req.prompt_ids
        arrival = req.arrival or time.perf_counter()
        with self._fetch(ids, req.cache_salt) as prefix:
            stats = prefix.stats
            if stats.fallback is not None and self.load_failure_policy == "fail":
                raise KVLoadFailed(f"KV load failed ({stats.fallback}): {stats.detail}")
            pre = prefill(self.model, ids, prefix.chunks or None, self.chunk_size, arena=self.arena)
        # the prefix is copied into the arena (settled): the read leases are released
        if pre.fallback is not None and self.connector is not None:
            self.connector.note_unusable(stats, pre.fallback)
            if self.load_failure_policy == "fail":
                raise KVLoadFailed(f"KV load failed (bad_chunk): {pre.fallback}")
        if self.connector is not None:
            self.connector.observe_prefill(pre.prefilled_tokens, pre.prefill_s)
        sample = Sampler(req.params)
        tok = sample(pre.logits)
        ttft = time.perf_counter() - arrival
        stored = 0
        if self.connector is not None and pre.n_new_chunks:
            # stored before decoding: the next request with this prefix finds it sooner
            stored = self.connector.store_new(
                ids, pre.first_new_chunk, pre.new_chunks(self.chunk_size), cache_salt=req.cache_salt
            ).stored
        stop_ids = req.params.stop_token_ids
        stops = frozenset(self.model.tokenizer.eos_token_ids if stop_ids is None else stop_ids)
        detok = Detokenizer(self.model.tokenizer.decode)
        matcher = StopMatcher(req.stop_strings)
        decoder = Decoder(
            self.model,
            pre.cache,
            sample,
            stops,
            req.params.max_new_tokens,
            cancel=cancel.is_set if cancel is not None else None,
        )
        generated = 0
        t_dec = time.perf_counter()
        for new in decoder.tokens(tok):
            generated += 1
            self.metrics.decoded_tokens.inc()
            piece = matcher.feed(detok.add(new))
            if piece and on_text is not None:
                on_text(piece)
            if matcher.stopped:
                break
        finish = "stop" if matcher.stopped else decoder.finish_reason
        if not matcher.stopped:
            tail = matcher.feed(detok.finish()) + matcher.flush()
            if tail and on_text is not None:
                on_text(tail)
        decode_s = time.perf_counter() - t_dec
        cached = pre.cached_tokens
        peer = min(stats.peer_chunks * self.chunk_size, cached) if pre.fallback is None else 0
        return GenOutcome(
            text=matcher.text,
            completion_tokens=generated,
            finish_reason=finish,
            prompt_tokens=pre.prompt_tokens,
            cached_tokens=cached,
            peer_cached_tokens=peer,
            prefilled_tokens=pre.prefilled_tokens,
            ttft_s=ttft,
            load_s=stats.lookup_s + pre.build_s,
            decode_s=decode_s,
            fallback=stats.fallback,
            stored_chunks=stored,
            breakdown_ms={
                "lookup": (stats.lookup_s - stats.verify_s) * 1000,
                **{f"p2p_{k}": v for k, v in stats.server_ms.items()},
                "verify": stats.verify_s * 1000,
                "build_cache": pre.build_s * 1000,
                "prefill": pre.prefill_s * 1000,
            },
        )


def load_with_progress(config: EngineConfig) -> LoadedModel:
    """``load_model`` with log lines while it runs (a first SmolLM2 load is slow)."""
    log.info("loading model %s (%s)", config.model, config.dtype)
    t0 = time.monotonic()
    ticker = Periodic(
        "kvatlas-load-progress",
        5.0,
        lambda: log.info("still loading model %s (%.0f s)", config.model, time.monotonic() - t0),
    )
    ticker.start()
    try:
        model = load_model(
            config.model,
            config.dtype,
            conversion_cache=config.model_cache_dir,
            num_threads=config.num_threads,
        )
    finally:
        ticker.stop()
    s = model.kv_spec
    log.info(
        "loaded %s from %s in %.1f s: %d layers, %d KV heads of dim %d, %s KV (%d KiB per token)",
        model.name,
        model.source,
        time.monotonic() - t0,
        s.layers,
        s.kv_heads,
        s.head_dim,
        s.dtype,
        s.bytes_per_token // 1024,
    )
    return model


class EngineApp:
    """Builds and names every part of the engine; ``start``/``stop`` or ``run``.

    ``model`` may be passed in (already loaded) by tests and embedders; otherwise it is
    loaded from ``config.model``.
    """

    def __init__(self, config: EngineConfig, *, model: LoadedModel | None = None) -> None:
        config.validate()
        self.config = config
        # bound before the model loads: a port in use fails in a second, not after a load
        self.http = AsgiThread(
            config.host, config.port, what="the OpenAI HTTP server", flag="--host/--port"
        )
        self.port: int = self.http.port
        try:
            self.model = model if model is not None else load_with_progress(config)
        except BaseException:
            self.http.stop()
            raise
        self.client: CacheClient | None = None
        self.connector: KVConnector | None = None
        if config.cache is not None:
            self.client = CacheClient(
                config.cache.url,
                timeout_s=config.cache.timeout_s,
                engine_id=f"engine-{self.model.name}-{self.port}",
                auth_token=config.cache.auth_token,
            )
            self.connector = KVConnector(
                self.model.contract(config.chunk_size),
                self.client,
                timeout_s=config.cache.timeout_s,
                reconnect_interval_s=config.cache.reconnect_interval_s,
                lease_s=config.cache.lease_s,
                verify_checksums=config.cache.verify_checksums,
                openai_url=self.advertised_url,
            )
        arena = KVArena(self.model.kv_spec)
        self.metrics = EngineMetrics(self.connector, arena)
        self.core = EngineCore(
            self.model,
            self.connector,
            self.metrics,
            chunk_size=config.chunk_size,
            max_model_len=config.max_model_len,
            load_failure_policy=config.kv_load_failure_policy,
            default_max_tokens=config.default_max_tokens,
            arena=arena,
        )
        self.app = build_app(self.core, served_name=config.served_name)
        self._stop = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def advertised_url(self) -> str:
        """Where routers reach this engine (``--advertise-url``, else the bound address;
        a wildcard host is advertised as loopback)."""
        if self.config.advertise_url:
            return self.config.advertise_url.rstrip("/")
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Register with the cache server (ContractRejected propagates), warm up, serve."""
        if self.connector is not None:
            assert self.config.cache is not None
            if not self.connector.start():
                log.warning(
                    "cache server %s unreachable; serving without a cache, retrying every %.0f s",
                    self.config.cache.url,
                    self.config.cache.reconnect_interval_s,
                )
        else:
            log.info("running without a cache server (--no-cache)")
        self.core.submit(self.core.warmup).result()
        self.http.start(self.app, name="kvatlas-engine-http", timeout_s=timeout_s)
        log.info("serving %s at %s (OpenAI API under /v1)", self.config.served_name, self.url)

    def stop(self) -> None:
        self._stop.set()
        self.http.stop()
        self.core.close()
        if self.connector is not None:
            self.connector.close()

    def run(self) -> None:
        """Start, serve until SIGTERM or SIGINT, stop."""
        serve_until_signal(self.http, self._stop, self.start, self.stop)
