"""The Mooncake KV Indexer RFC routes (kvcache-ai/Mooncake#1403) as NVIDIA Dynamo 1.6.1's
standalone indexer (``python -m dynamo.indexer``) answers them, over the device tier
(``--kv-indexer-api``; docs/dynamo.md is the reference):

- ``POST /register``: a worker, one ``instance_id`` and ``dp_rank`` publishing vLLM KV
  events on ``endpoint`` (and replaying on ``replay_endpoint``), joins the partition
  ``(model_name, routing_group)``, whose workers share one ``block_size``; it becomes the
  device tier's engine ``"{instance_id}:{dp_rank}"``, subscribed at once (a full replay).
  An instance lives in one partition, as in Dynamo, so the engine id needs no model;
- ``POST /unregister``: the instance's ranks (or the one named) leave, their blocks
  dropped; a partition left empty is gone;
- ``GET /workers``: the registered workers, filtered by ``model_name`` and
  ``routing_group`` when asked;
- ``POST /query``: per worker and rank, the leading tokens of ``token_ids`` its GPU holds
  (``scores``), and per worker the RFC's tiered summary (``instances``); ``frequencies``
  is empty, as 1.6.1's;
- ``POST /query_by_hash``: the same from Dynamo's local block hashes (no salt);
- ``GET /dump``: every partition's blocks as Dynamo's stored events.

Tenants: kvatlas keys KV by ``cache_salt``, as vLLM does, where Dynamo 1.6.1 accepts a
``tenant_id`` and ignores it. A query's ``tenant_id`` names the tenant whose salt
(``--tenants``) the lookup hashes with (``"default"``: unsalted, or the query's own
``cache_salt``), so one engine serving several tenants is registered once and each
tenant's query sees its own blocks only. Registrations outlive a restart in
``<--snapshot-path>.indexer``, written before a change applies (none without a snapshot
path, as in Dynamo). The routes are behind the coordinator's bearer token, ``/dump``
(every tenant's blocks) behind the operator token when one is set. Where kvatlas answers
otherwise than Dynamo, on purpose, docs/dynamo.md names it ("Intended differences").

Owns the routes' checks, the writing of the registrations' file, and the translation
of device-tier hits into Dynamo's answers; the shapes are `kvatlas.wire.indexer_api`'s,
the registry's rules `kvatlas.coordinator.indexer.registry`'s.
Must not: subscribe, hash or index (that is `kvatlas.coordinator.vllm.ingest` over
`kvatlas.core`), nor change any state but its registry and the sources it added.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvatlas.coordinator.http.app import HttpError
from kvatlas.coordinator.http.auth import OperatorCheck
from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.http.edge.routing import Router, always
from kvatlas.coordinator.indexer.registry import Worker, WorkerRegistry, endpoint_error
from kvatlas.coordinator.snapshot import frame, write_atomic
from kvatlas.coordinator.vllm.ingest import DeviceHit, VllmIngest
from kvatlas.core.device_blocks import DumpedBlock, EngineId
from kvatlas.core.errors import ConfigError
from kvatlas.wire.decoding import decode_or_refuse
from kvatlas.wire.http_api import ErrorResponse
from kvatlas.wire.indexer_api import (
    DEFAULT,
    DumpBlock,
    DumpData,
    DumpEvent,
    DumpKvEvent,
    DumpPartition,
    DumpStored,
    InstanceSummary,
    ListenerInfo,
    QueryByHashRequest,
    QueryRequest,
    RegisterRequest,
    ScoreResponse,
    StatusResponse,
    UnregisterRequest,
    WorkerInfo,
)

log = logging.getLogger(__name__)

_TIERS = {"GPU": "device", "CPU": "host_pinned", "STORAGE": "disk"}
"""vLLM's media as Dynamo's storage tiers in ``/dump`` (others: ``external``)."""
_T = TypeVar("_T")
_register_decoder = msgspec.json.Decoder(RegisterRequest)
_unregister_decoder = msgspec.json.Decoder(UnregisterRequest)
_query_decoder = msgspec.json.Decoder(QueryRequest)
_by_hash_decoder = msgspec.json.Decoder(QueryByHashRequest)
_encoder = msgspec.json.Encoder()


def _tiers(hit: DeviceHit) -> tuple[int, int, int]:
    """A hit's leading tokens on GPU, then through CPU, then through every tier (the
    RFC's cumulative ``gpu``, ``cpu``, ``disk``), from the blocks each tier serves."""
    if not hit.tiers:
        return 0, 0, 0
    gpu, cpu, disk = (n * hit.block_size for n in hit.tiers)
    return gpu, gpu + cpu, gpu + cpu + disk


class IndexerApi:
    """The six routes over one ingest, and the registrations they made."""

    def __init__(
        self,
        ingest: VllmIngest,
        *,
        tenant_names: Iterable[tuple[str, str]] = (),
        max_tokens: int,
        max_hashes: int,
        book: Path | None = None,
        kept: Sequence[Worker] = (),
        operator: OperatorCheck | None = None,
    ) -> None:
        """``tenant_names``: the coordinator's ``(cache_salt, tenant:ID | shared:NAME)``
        pairs (``--tenants``); ``book``: the registrations' file, ``kept`` what it held
        at startup (`load_book`), subscribed again by `start`; ``operator``: who may
        read ``/dump`` (every salt's blocks) when an operator token is set."""
        self._ingest = ingest
        self._salts = {
            name.removeprefix("tenant:"): salt
            for salt, name in tenant_names
            if name.startswith("tenant:")
        }
        self._max_tokens = max_tokens
        self._max_hashes = max_hashes
        self._book = book
        self._operator = operator or OperatorCheck("")
        self._lock = threading.Lock()
        self.registry = WorkerRegistry()
        self._kept = list(kept)

    # -- the part's life: registrations of the last run come back --------------------

    def start(self) -> None:
        """Subscribe again to the workers the file keeps (a full replay each)."""
        refused: list[Worker] = []
        with self._lock:
            for w in self._kept:
                try:
                    self.registry.check_register(w)
                    self._ingest.add_source(w.source())
                except (HttpError, ConfigError) as exc:
                    refused.append(w)
                    log.warning(
                        "Indexer API: registered worker %s of model=%s routing_group=%s"
                        " not restored: %s",
                        w.engine,
                        w.model_name,
                        w.routing_group,
                        exc,
                    )
                    continue
                self.registry.add(w)
            if self._kept:
                log.info(
                    "Indexer API: %d registered workers restored from %s",
                    len(self._kept) - len(refused),
                    self._book,
                )
            if refused:
                try:
                    self._write(self.registry.workers())
                except HttpError as exc:  # the next change writes it again
                    log.error("Indexer API: %s", exc.reason)
        self._kept = []

    def stop(self) -> None:
        """Nothing to do: the file is written at every change; the ingest stops itself."""

    def workers_count(self) -> int:
        with self._lock:
            return len(self.registry.workers())

    def attach(self, registry: CollectorRegistry) -> None:
        registry.register(_Collector(self))

    # -- routes ----------------------------------------------------------------------

    def add_routes(self, router: Router) -> None:
        # All in the thread pool: registrations write a file and subscribe under the
        # lock that every route takes, and queries hash their tokens.
        router.add("POST", "/register", self.register, offload=always)
        router.add("POST", "/unregister", self.unregister, offload=always)
        router.add("GET", "/workers", self.workers, offload=always)
        router.add("POST", "/query", self.query, offload=always)
        router.add("POST", "/query_by_hash", self.query_by_hash, offload=always)
        router.add("GET", "/dump", self.dump, offload=always)

    def register(self, request: HttpRequest) -> HttpResponse:
        body = _decode(_register_decoder, request)
        instance_id = _u64(body.instance_id)
        for what, ep in (("", body.endpoint), ("replay ", body.replay_endpoint)):
            why = None if ep is None else endpoint_error(ep)
            if why is not None:
                inner = f"invalid ZMQ endpoint `{ep}`: {why}"
                raise HttpError(400, f"invalid replay endpoint `{ep}`: {inner}" if what else inner)
        if body.block_size == 0:
            raise HttpError(400, "block_size must be at least 1")
        w = Worker(
            instance_id,
            body.dp_rank or 0,
            body.model_name,
            body.routing_group,
            body.block_size,
            body.endpoint,
            body.replay_endpoint,
        )
        with self._lock:
            self.registry.check_register(w)
            try:
                self._ingest.add_source(w.source())
            except ConfigError as exc:  # the engine id is a --vllm-kv-events engine's
                raise HttpError(409, str(exc)) from exc
            try:
                self._write([*self.registry.workers(), w])
            except HttpError:
                self._ingest.remove_source(w.engine)
                raise
            self.registry.add(w)
        return _json(StatusResponse("ok"), 201)

    def unregister(self, request: HttpRequest) -> HttpResponse:
        body = _decode(_unregister_decoder, request)
        with self._lock:
            leaving = self.registry.leaving(
                _u64(body.instance_id), body.model_name, body.routing_group, body.dp_rank
            )
            self._write([w for w in self.registry.workers() if w not in leaving])
            for w in leaving:
                self._ingest.remove_source(w.engine)
            self.registry.remove(leaving)
        return _json(StatusResponse("ok"))

    def workers(self, request: HttpRequest) -> HttpResponse:
        q = request.query
        model, group = q.get("model_name"), q.get("routing_group")
        with self._lock:
            found = [
                w
                for w in self.registry.workers()
                if model in (None, w.model_name) and group in (None, w.routing_group)
            ]
        by_instance: dict[int, list[Worker]] = {}
        for w in found:
            by_instance.setdefault(w.instance_id, []).append(w)
        out = []
        for iid, ranks in by_instance.items():
            first = ranks[0]
            out.append(
                WorkerInfo(
                    iid,
                    "zmq",
                    "active",
                    first.model_name,
                    first.routing_group,
                    first.block_size,
                    {str(w.dp_rank): w.endpoint for w in ranks},
                    {str(w.dp_rank): ListenerInfo(w.endpoint, "active") for w in ranks},
                )
            )
        return _json(out)

    def query(self, request: HttpRequest) -> HttpResponse:
        body = _decode(_query_decoder, request)
        if len(body.token_ids) > self._max_tokens:
            raise HttpError(
                413,
                f"{len(body.token_ids)} token ids, over --max-lookup-tokens {self._max_tokens}",
            )
        workers = self._partition(body.model_name, body.routing_group)
        salt = self._salt(body.tenant_id, body.cache_salt)
        hits = self._ingest.lookup(
            body.token_ids,
            lora_name=body.lora_name,
            cache_salt=salt,
            engines=[w.engine for w in workers],
        )
        return _json(_scores(workers, hits))

    def query_by_hash(self, request: HttpRequest) -> HttpResponse:
        body = _decode(_by_hash_decoder, request)
        if body.cache_salt is not None:
            raise HttpError(
                400,
                "cache_salt is not accepted by /query_by_hash: local block hashes carry no"
                " salt and match unsalted blocks only; ask POST /query with the salt",
            )
        if body.tenant_id != DEFAULT:
            raise HttpError(
                400,
                "tenant_id is not accepted by /query_by_hash: local block hashes carry no"
                " salt and match unsalted blocks only; ask POST /query for the tenant",
            )
        if len(body.block_hashes) > self._max_hashes:
            raise HttpError(
                413,
                f"{len(body.block_hashes)} block hashes, over --max-lookup-keys {self._max_hashes}",
            )
        workers = self._partition(body.model_name, body.routing_group)
        hits = self._ingest.lookup_by_local_hashes(
            body.block_hashes, engines=[w.engine for w in workers]
        )
        return _json(_scores(workers, hits))

    def dump(self, request: HttpRequest) -> HttpResponse:
        if not self._operator.sees_tenants(request):
            raise HttpError(
                403, "the dump holds every tenant's blocks: it needs the operator token"
            )
        with self._lock:
            parts = self.registry.partitions()
        blocks = self._ingest.dump([w.engine for _, ws in parts for w in ws])
        out: dict[str, DumpPartition] = {}
        for (model, group), workers in parts:
            events: list[DumpEvent] = []
            for w in workers:
                events.extend(_dump_events(w, blocks.get(w.engine, ()), len(events)))
            out[f"{model}:{group}"] = DumpPartition(workers[0].block_size, events)
        return _json(out)

    # -- helpers ---------------------------------------------------------------------

    def _partition(self, model_name: str, routing_group: str) -> list[Worker]:
        with self._lock:
            return self.registry.partition(model_name, routing_group)

    def _salt(self, tenant_id: str, cache_salt: str | None) -> str | None:
        """The salt a query hashes with: its ``cache_salt``, or its tenant's."""
        if tenant_id == DEFAULT:
            return cache_salt or None
        salt = self._salts.get(tenant_id)
        if salt is None:
            raise HttpError(
                404,
                f"unknown tenant_id {tenant_id!r}: not a tenant of this coordinator's"
                " --tenants file, so its salt is unknown (default: unsalted)",
            )
        if cache_salt and cache_salt != salt:
            raise HttpError(400, "tenant_id and cache_salt name different salts: send one of them")
        return salt

    def _write(self, workers: list[Worker]) -> None:
        """Keep ``workers`` in the file (when there is one); HttpError 503 on failure."""
        if self._book is None:
            return
        try:
            write_atomic(self._book, frame(msgspec.msgpack.encode(workers)))
        except OSError as exc:
            raise HttpError(
                503, f"the registration was not applied: {self._book} cannot be written ({exc})"
            ) from exc

    def openapi_paths(self) -> dict[str, Any]:
        def content(t: Any) -> dict[str, Any]:
            return {"application/json": {"schema": msgspec.json.schema(t)}}

        def error(what: str) -> dict[str, Any]:
            return {"description": what, "content": content(ErrorResponse)}

        bad = {
            "400": error("Malformed JSON, or a value refused, with a reason"),
            "401": error("Missing or wrong bearer token"),
            "415": error("Not Content-Type: application/json"),
            "422": error("JSON of the wrong shape (a field missing, of the wrong type)"),
        }

        def post(summary: str, req: type, ok: str, resp: type, more: dict[str, Any]) -> Any:
            return {
                "post": {
                    "summary": summary,
                    "requestBody": {"required": True, "content": content(req)},
                    "responses": {ok: {"description": "OK", "content": content(resp)}} | bad | more,
                }
            }

        no_partition = {"404": error("No worker registered for model_name and routing_group")}
        query_more = no_partition | {"413": error("Over --max-lookup-tokens / --max-lookup-keys")}
        return {
            "/register": post(
                "Register a vLLM worker's KV event stream (Mooncake KV Indexer RFC, Dynamo"
                " 1.6.1's shape): subscribed at once, with a full replay",
                RegisterRequest,
                "201",
                StatusResponse,
                {
                    "409": error("Instance or rank registered, or another block_size"),
                    "503": error("The registrations' file cannot be written"),
                },
            ),
            "/unregister": post(
                "Unregister an instance (every rank, or dp_rank), dropping its blocks",
                UnregisterRequest,
                "200",
                StatusResponse,
                {
                    "404": error("No such instance or rank"),
                    "503": error("The registrations' file cannot be written"),
                },
            ),
            "/workers": {
                "get": {
                    "summary": "Registered workers (query: model_name, routing_group)",
                    "responses": {
                        "200": {"description": "OK", "content": content(list[WorkerInfo])},
                        "401": bad["401"],
                    },
                }
            },
            "/query": post(
                "Per registered worker and rank, the leading tokens of token_ids its caches"
                " hold, hashed with the tenant's salt (tenant_id) or cache_salt",
                QueryRequest,
                "200",
                ScoreResponse,
                query_more | {"404": error("No such partition, or an unknown tenant_id")},
            ),
            "/query_by_hash": post(
                "The same from Dynamo's local block hashes (unsalted blocks only)",
                QueryByHashRequest,
                "200",
                ScoreResponse,
                query_more,
            ),
            "/dump": {
                "get": {
                    "summary": "Every partition's blocks as Dynamo's stored events",
                    "responses": {
                        "200": {
                            "description": "OK",
                            "content": content(dict[str, DumpPartition]),
                        },
                        "401": bad["401"],
                        "403": error("An operator token is set and the request lacks it"),
                    },
                }
            },
        }


def _decode(decoder: msgspec.json.Decoder[_T], request: HttpRequest) -> _T:
    """The body as Dynamo's axum reads it: 415 unless JSON, 400 when it does not parse,
    422 when it is JSON of the wrong shape."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json" and not (
        kind.startswith("application/") and kind.endswith("+json")
    ):
        raise HttpError(415, "Expected request with `Content-Type: application/json`")
    return decode_or_refuse(decoder, request.body, HttpError)


def _u64(value: int) -> int:
    if value >= 1 << 64:
        raise HttpError(
            422, f"invalid body: Expected `int` <= {(1 << 64) - 1} - at `$.instance_id`"
        )
    return value


def _json(obj: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, _encoder.encode(obj))


def _scores(workers: Sequence[Worker], hits: Iterable[DeviceHit]) -> ScoreResponse:
    by_engine = {w.engine: w for w in workers}
    scores: dict[str, dict[str, int]] = {}
    tiers: dict[str, list[int]] = {}  # instance -> [gpu, cpu, disk]
    dp: dict[str, dict[str, int]] = {}
    for hit in hits:
        w = by_engine.get(EngineId(hit.engine))
        if w is None or not hit.tokens:
            continue
        gpu, cpu, disk = _tiers(hit)
        iid, rank = str(w.instance_id), str(w.dp_rank)
        if gpu:
            scores.setdefault(iid, {})[rank] = gpu
        dp.setdefault(iid, {})[rank] = gpu
        best = tiers.setdefault(iid, [0, 0, 0])
        best[:] = [max(best[0], gpu), max(best[1], cpu), max(best[2], disk)]
    instances = {
        iid: InstanceSummary(max(g, c, d), g, dp[iid], c, d) for iid, (g, c, d) in tiers.items()
    }
    return ScoreResponse(scores, [], instances)


def _dump_events(w: Worker, blocks: Iterable[DumpedBlock], first_id: int) -> list[DumpEvent]:
    """One stored event per block and medium. Blocks stored without token ids are left
    out: they have no local hash, and Dynamo never holds such blocks."""
    out: list[DumpEvent] = []
    for b in blocks:
        if not b.tokens_hash:
            continue
        for medium in b.media:
            stored = DumpStored(b.parent_hash, None, [DumpBlock(b.block_hash, b.tokens_hash)])
            event = DumpKvEvent(first_id + len(out), DumpData(stored), w.dp_rank)
            tier = _TIERS.get(medium, "external")
            out.append(DumpEvent(w.instance_id, tier, "worker", event))
    return out


class _Collector(Collector):
    def __init__(self, api: IndexerApi) -> None:
        self._api = api

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "kvatlas_vllm_indexer_workers",
            "Workers (instance, dp_rank) registered through the indexer API (--kv-indexer-api)",
            value=self._api.workers_count(),
        )
