"""The router's composition on one event loop: one request's routing, and the loops.

Owns, for ``kvatlas router``, the wiring of one object per concern and the request's
path through them:

- the prompt's token ids (``tokens.PromptTokens``: a completion's token-id prompt as it
  is, else the local tokenizer's or an engine's ``/tokenize``), one prompt in
  ``tokenizer_verify_every`` checked against the tokenizer's own encoder after routing
  (``checks.EncoderChecks``);
- every tier's answer for those tokens, gathered in one place (``tier_gather``): the
  prefixes sent to engines moments ago that the coordinator cannot know yet
  (``pending``), the coordinator's chunk lookup of every instance's cached prefix behind
  its breaker (``lookups.CoordinatorLookups``) and its device lookup
  (``device_lookup.DeviceLookups``); a failed tokenize, or no tier that can route,
  routes this request by load (``least-loaded``) instead of failing;
- the choice (``policy.Chooser``) over the engines available (``engines.EngineTable``),
  and the attempts down its ranking, at most ``max_attempts``, each relayed or failed
  over by ``relay.Relay``;
- the loops: the coordinator's listing every ``refresh_interval_s`` and a probe of every
  engine every ``health_interval_s`` (``health.EngineHealth``).

Each step of the routing (tokenize, hash, lookup and the coordinator's own part of it,
pick, and the collector's pauses inside) goes to its histogram. Must not: parse or
rewrite what an engine answers, read configuration, or block the loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from kvatlas.core.breaker import BreakerPolicy
from kvatlas.core.errors import ServiceError
from kvatlas.core.tenancy import SaltRefused
from kvatlas.router.auth import Caller, caller_of
from kvatlas.router.checks import EncoderChecks
from kvatlas.router.clients import EngineClients
from kvatlas.router.config import RouterConfig
from kvatlas.router.device_lookup import DeviceLookups
from kvatlas.router.engines import EngineTable
from kvatlas.router.health import EngineHealth
from kvatlas.router.lookups import CoordinatorLookups
from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.pending import PendingPrefixes
from kvatlas.router.policy import KV_POLICIES, Candidate, Chooser, Decision, Policy
from kvatlas.router.relay import HOP_BY_HOP, REQUEST_ID_HEADER, ROUTE_HEADER, Plan, Relay
from kvatlas.router.relay import error_body as _error_body
from kvatlas.router.tenants import TenantsFile, request_salt, with_salt
from kvatlas.router.tier_gather import PendingTier, TierGather
from kvatlas.router.tiers import Ask, TierView
from kvatlas.router.tokens import JSON, LocalTokenizer, PromptTokens, prompt_blob
from kvatlas.router.tripwires import Tripwires
from kvatlas.runtime.coordinator_client import CoordinatorClient
from kvatlas.runtime.gc_pauses import GcPauses

__all__ = ["ROUTE_HEADER", "LocalTokenizer", "Plan", "RouterService"]

log = logging.getLogger(__name__)

_BYTES_PER_TOKEN_GUESS = 4
"""Without a tokenize (policies that need no prefix), prompt tokens are guessed from
the body's length: only the load accounting uses them."""


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
        self.tokenizer = tokenizer
        self._clock = clock
        self.table = EngineTable(
            BreakerPolicy(threshold=config.breaker_failures, cooloff_s=config.breaker_open_s)
        )
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
        self.tenants = (
            TenantsFile(config.tenants_file, self.metrics.registry) if config.tenants_file else None
        )
        self.wires = Tripwires()
        self.clients = EngineClients(config)
        self.tokens = PromptTokens(config, tokenizer, self.clients, self.metrics)
        self.checks = EncoderChecks(tokenizer, config.tokenizer_verify_every, self.metrics)
        self.lookups = CoordinatorLookups(
            config,
            coordinator.async_lookups() if coordinator is not None else None,
            self.wires,
            self.metrics,
            clock,
        )
        self.health = EngineHealth(
            config,
            coordinator,
            table=self.table,
            clients=self.clients,
            wires=self.wires,
            metrics=self.metrics,
            clock=clock,
        )
        self.device = DeviceLookups(
            # the coordinator client's replica state: a replica its lookups found down
            # is skipped by the device lookups too, and the other way round
            coordinator.replicas if coordinator is not None else None,
            auth_token=config.auth_token,
            timeout_s=config.lookup_timeout_s,
            registry=self.metrics.registry,
            backoff_s=config.coordinator_backoff_s,
            clock=clock,
        )
        self.tiers = TierGather(
            (PendingTier(self.pending, self.metrics, clock), self.lookups, self.device)
        )
        self.relay = Relay(
            config, self.clients, self.wires, self.metrics, clock, count_tier=self.device.count_tier
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.failed = 0
        """Requests no engine answered (a 502)."""

    @property
    def routed(self) -> int:
        """Requests relayed to an engine (``/v1/models`` aside)."""
        return self.relay.routed

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """The tokenizer readied on both threads that call it, one listing and one round
        of probes, then the loops."""
        self.gc.install()
        await self.tokens.warm()
        await self.health.refresh()
        await self.health.probe_all()
        self._tasks = [
            asyncio.create_task(self._every(self.config.refresh_interval_s, self.health.refresh)),
            asyncio.create_task(self._every(self.config.health_interval_s, self.health.probe_all)),
        ]
        if self.tenants is not None:
            self._tasks.append(asyncio.create_task(self._every(1.0, self._reload_tenants)))

    async def _reload_tenants(self) -> None:
        if self.tenants is not None:
            self.tenants.maybe_reload()

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        await self.clients.aclose()
        await self.lookups.aclose()
        await self.device.aclose()
        self.gc.remove()
        self.tokens.close()
        self.checks.close()

    async def _every(self, interval: float, step: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await step()  # type: ignore[misc]
            except Exception:
                log.exception("router loop step %s failed", getattr(step, "__name__", step))

    # ------------------------------------------------------------------ routing

    async def plan(
        self, body: bytes, endpoint: str = "/v1/chat/completions", salt: str = ""
    ) -> Plan:
        """Tokenize, look up and rank; ServiceError when no engine is available. ``salt``:
        the request's ``cache_salt``; every lookup and pending prefix is of that salt's
        KV alone."""
        t0 = time.perf_counter()
        gc0 = self.gc.total
        engines = self.table.available(self._clock())
        if not engines:
            raise ServiceError("no engine is available")
        policy: Policy = self.config.policy
        tokenized_here = False
        prompt = 0
        view = TierView(())
        blob: bytes | None = None
        if policy in KV_POLICIES:
            t_hash = time.perf_counter()
            blob = prompt_blob(body) if endpoint == "/v1/completions" else None
            if blob is None:
                blob = await self.tokens.encode(engines, body)
                t_hash = time.perf_counter()
                tokenized_here = blob is not None and self.tokenizer is not None
            routes = False
            if blob is not None:
                model = self.config.model_name or self.table.model_name()
                gathered = await self.tiers.gather(Ask(blob, model, salt, t_hash))
                view, routes = gathered.view, gathered.routes
            if not routes:  # no tier knows the prompt: route by load
                policy = "least-loaded"
            else:
                assert blob is not None
                prompt = len(blob) // 4
                self.metrics.prompt_tokens.inc(prompt)
        fleet = view.fleet
        if not prompt:
            prompt = len(body) // _BYTES_PER_TOKEN_GUESS
        t_pick = time.perf_counter()
        candidates = [
            Candidate(
                e.url,
                e.load,
                e.queued_tokens,
                view.local(e.url, e.instance_id),
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
        if tokenized_here and blob is not None:
            # after the choice: the check's CPU does not delay this request's lookup
            self.checks.maybe_check(body, blob)
        tiers = view.tiers(
            (c.name, self.table.engines[c.name].instance_id, c.cached_tokens)
            for c in decision.ranked
        )
        return Plan(decision, policy, prompt, end - t0, blob or b"", salt, tiers)

    # ------------------------------------------------------------------ proxying

    async def forward(self, request: Request) -> Response:
        """Route one request and relay the chosen engine's answer."""
        endpoint = request.url.path
        caller = caller_of(request.scope)
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        rid = headers.setdefault(REQUEST_ID_HEADER, uuid.uuid4().hex)
        if caller.tenant is not None:
            # the tenant's key stays here: the engines know the fleet's token, if any
            headers.pop("authorization", None)
            if self.config.auth_token:
                headers["authorization"] = f"Bearer {self.config.auth_token}"
        try:
            if request.method == "POST":
                salt, body = self._salted(caller, body)
                plan = await self.plan(body, endpoint, salt)
            else:
                plan = self._any_engine()
        except SaltRefused as exc:
            return self._refuse(endpoint, exc.status, str(exc), "invalid_request_error", caller)
        except ServiceError as exc:
            return self._refuse(endpoint, 503, str(exc), "service_unavailable", caller)
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
                self.pending.note(plan.blob, e.url, self._clock(), plan.salt)
            head = await self.relay.attempt(
                e, choice, method=request.method, endpoint=endpoint, body=body, headers=headers
            )
            if head is None:
                if plan.blob:
                    self.pending.forget(plan.blob, e.url, plan.salt)
                continue
            self._count_tenant(caller, head.resp.status_code)
            return self.relay.respond(
                e,
                choice,
                plan,
                head,
                endpoint=endpoint,
                rid=rid,
                attempt=len(attempts),
                expose_route=caller.is_operator or self.config.expose_route_header,
            )
        self.failed += 1
        return self._refuse(
            endpoint,
            502,
            f"no engine answered (tried {', '.join(attempts) or 'none'})",
            "bad_gateway",
            caller,
        )

    def _salted(self, caller: Caller, body: bytes) -> tuple[str, bytes]:
        """The request's salt and the body the engine gets: a tenant's salt derived and
        set in the body (``core.tenancy``), else the body's own ``cache_salt``."""
        client = request_salt(body)
        if caller.tenant is None or self.tenants is None:
            return client or "", body
        salt = self.tenants.table.salt_for(caller.tenant, client)
        return salt, with_salt(body, salt)

    def _count_tenant(self, caller: Caller, code: int) -> None:
        if caller.tenant is not None:
            self.metrics.tenant_requests.labels(caller.tenant.tenant_id, str(code)).inc()

    def _any_engine(self) -> Plan:
        engines = self.table.available(self._clock())
        if not engines:
            raise ServiceError("no engine is available")
        cands = [Candidate(e.url, e.load, e.queued_tokens) for e in engines]
        decision = self.chooser.rank(cands, 0, 0, policy="least-loaded")
        return Plan(decision, "least-loaded", 0, 0.0)

    def _refuse(
        self, endpoint: str, code: int, message: str, kind: str, caller: Caller | None = None
    ) -> Response:
        self.metrics.requests.labels(endpoint, str(code)).inc()
        if caller is not None:
            self._count_tenant(caller, code)
        return Response(_error_body(message, kind), status_code=code, media_type=JSON)
