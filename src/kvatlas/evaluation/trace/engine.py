"""The trace engine: one node's engine in a trace replay, prefilling by a cost model.

Owns, for ``kvatlas bench trace``, what stands in for a GPU engine on this CPU machine:

- the OpenAI completions API over token ids (what ``kvatlas router`` sends it), with
  ``usage.prompt_tokens_details.cached_tokens`` and ``cached_token_stats`` in every
  answer, and the ``/metrics`` the router probes (requests running, prefilled tokens and
  seconds, peer-read tokens and seconds: the rates ``kv-p2p`` prices with);
- one prefill at a time, in arrival order (a prefill node's queue: the paper's
  disaggregated prefill nodes, whose TTFT is queueing plus prefill; decoding runs
  elsewhere and is not modelled);
- for each request the real cache path: the prompt's cached prefix asked of the node's
  ``kvatlas server`` through the connector (local L1, then peers over P2P, read leases,
  checksums), the rest "prefilled" by sleeping its modelled time (the cost profile's
  ``prefill_s(cached, total)``, divided by ``speed``), then the new chunks stored through
  the connector: real
  bytes, ``chunk_bytes`` per chunk, so every lookup, lock, transfer and eviction is the
  real one at a chosen KV size.

Must not: tokenize (a trace prompt is token ids), or read flags.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvatlas.connector.client import CacheClient
from kvatlas.connector.kv_connector import KVConnector
from kvatlas.core.keys import HashContract
from kvatlas.evaluation.trace.simulate import CostProfile
from kvatlas.runtime.asgi_thread import AsgiThread

log = logging.getLogger(__name__)

_JSON: Final = "application/json"
_KV_DTYPE: Final = "float16"


class _Completion(msgspec.Struct):
    prompt: list[int]
    max_tokens: int = 1
    cache_salt: str | None = None


_decode: Final = msgspec.json.Decoder(_Completion)


def trace_contract(model: str, chunk_tokens: int, chunk_bytes: int) -> HashContract:
    """The contract of a trace engine whose chunks hold ``chunk_bytes`` each (one layer,
    one head, float16: the head dim makes the size); ValueError when it cannot."""
    per_dim = 2 * chunk_tokens * 2  # K and V, float16
    if chunk_bytes % per_dim or chunk_bytes < per_dim:
        raise ValueError(
            f"chunk bytes {chunk_bytes} must be a multiple of {per_dim}"
            f" (K and V of {chunk_tokens} float16 tokens)"
        )
    return HashContract(
        model_name=model,
        chunk_size=chunk_tokens,
        kv_dtype=_KV_DTYPE,
        kv_layout=(1, 1, chunk_bytes // per_dim),
    )


@dataclass(frozen=True, slots=True)
class Served:
    """What one request cost, in wall seconds of the replay and tokens."""

    prompt_tokens: int
    cached_tokens: int
    peer_tokens: int
    prefilled_tokens: int
    queued_s: float
    lookup_s: float
    prefill_s: float
    fallback: str | None


class TraceEngine:
    """One node's engine (see the module doc); ``start``/``stop``."""

    def __init__(
        self,
        name: str,
        *,
        cache_url: str,
        contract: HashContract,
        profile: CostProfile,
        speed: float,
        host: str = "127.0.0.1",
        port: int = 0,
        auth_token: str | None = None,
    ) -> None:
        self.name = name
        self.contract = contract
        self.profile = profile
        self.speed = speed
        self.http = AsgiThread(host, port, what=f"trace engine {name}", flag="--port")
        self.url = f"http://{host}:{self.http.port}"
        client = CacheClient(cache_url, timeout_s=10.0, engine_id=name, auth_token=auth_token)
        self.connector = KVConnector(contract, client, timeout_s=10.0, openai_url=self.url)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"trace-{name}")
        self._chunk_bytes = contract.chunk_nbytes
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        r, ns = self.registry, "kvatlas_engine"
        self.running = Gauge(f"{ns}_requests_running", "Requests queued or prefilling", registry=r)
        self.prefilled = Counter(f"{ns}_prefilled_tokens", "Prompt tokens prefilled", registry=r)
        self.prefill_s = Counter(f"{ns}_prefill_seconds", "Seconds spent prefilling", registry=r)
        self.peer_tokens = Counter(
            f"{ns}_peer_cached_tokens", "Cached prompt tokens read from peers", registry=r
        )
        self.peer_s = Counter(
            f"{ns}_peer_fetch_seconds", "Seconds of lookups that read from peers", registry=r
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if not self.connector.start():
            raise RuntimeError(f"trace engine {self.name}: its cache server does not answer")
        app = Starlette(
            routes=[
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/healthz", self._healthz, methods=["GET"]),
            ]
        )
        self.http.start(app, name=f"trace-engine-{self.name}")

    def stop(self) -> None:
        self.http.stop()
        self._worker.shutdown(wait=True, cancel_futures=True)
        self.connector.close()

    # ------------------------------------------------------------------ one request

    def serve(self, tokens: list[int], salt: str, arrival: float) -> Served:
        """On the worker: look up, prefill the rest by the model, store the new chunks."""
        t0 = time.perf_counter()
        chunk = self.contract.chunk_size
        with self.connector.fetch_prefix(tokens, cache_salt=salt) as prefix:
            hit = len(prefix.chunks)
            stats = prefix.stats
        t1 = time.perf_counter()
        cached = hit * chunk
        prefilled = len(tokens) - cached
        prefill_s = self.profile.prefill_s(cached, len(tokens)) / self.speed
        time.sleep(prefill_s)
        self.connector.observe_prefill(prefilled, prefill_s)
        n_full = len(tokens) // chunk
        if n_full > hit:
            chunks = [self._chunk(tokens, i) for i in range(hit, n_full)]
            self.connector.store_new(tokens, hit, chunks, cache_salt=salt)
        peer = stats.peer_chunks * chunk
        with self._lock:
            self.prefilled.inc(prefilled)
            self.prefill_s.inc(prefill_s)
            if peer:
                self.peer_tokens.inc(peer)
                self.peer_s.inc(stats.lookup_s)
        return Served(
            len(tokens),
            cached,
            peer,
            prefilled,
            t0 - arrival,
            t1 - t0,
            prefill_s,
            str(stats.fallback) if stats.fallback is not None else None,
        )

    def _chunk(self, tokens: list[int], i: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Chunk ``i``'s KV bytes: its tokens repeated (a reader's checksum checks them)."""
        c = self.contract.chunk_size
        block = np.asarray(tokens[i * c : (i + 1) * c], dtype="<u4").view(np.uint8)
        reps = -(-self._chunk_bytes // block.size)
        return np.tile(block, reps)[: self._chunk_bytes]

    async def _complete(self, request: Request) -> Response:
        arrival = time.perf_counter()
        try:
            body = _decode.decode(await request.body())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Response(
                msgspec.json.encode({"error": {"message": str(exc), "type": "invalid_request"}}),
                status_code=400,
                media_type=_JSON,
            )
        self.running.inc()
        try:
            loop = asyncio.get_running_loop()
            out = await loop.run_in_executor(
                self._worker, self.serve, body.prompt, body.cache_salt or "", arrival
            )
        finally:
            self.running.dec()
        ttft_ms = (time.perf_counter() - arrival) * 1000
        answer = {
            "object": "text_completion",
            "model": self.name,
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": 0,
                "total_tokens": out.prompt_tokens,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
            },
            "cached_token_stats": {
                "num_cached_tokens": out.cached_tokens,
                "num_peer_cached_tokens": out.peer_tokens,
                "num_prefilled_tokens": out.prefilled_tokens,
                "num_prompt_tokens": out.prompt_tokens,
                "ttft_ms": ttft_ms,
                "queued_ms": out.queued_s * 1000,
                "lookup_ms": out.lookup_s * 1000,
                "prefill_ms": out.prefill_s * 1000,
                "fallback": out.fallback,
            },
        }
        return Response(msgspec.json.encode(answer), media_type=_JSON)

    async def _metrics(self, _: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def _healthz(self, _: Request) -> Response:
        ok = self.connector.connected
        return Response(
            msgspec.json.encode({"status": "ok" if ok else "no cache"}),
            status_code=200,
            media_type=_JSON,
        )
