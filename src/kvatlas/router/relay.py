"""One attempt at one engine, and the relay of its answer to the client.

Owns the proxying: the client's body and headers (``Authorization`` and the request id
included) to the chosen engine, its answer back byte for byte (a stream as it comes,
any other answer once it is whole). Nothing goes to the client before a stream's first
piece (its first event), or the whole of any other answer (up to
``max_held_answer_bytes``), is in, so an attempt that is refused, times out, answers
5xx or breaks off before that gives None and the request goes to its next choice as
invisibly as a refused connection (a refused connection marks the engine down at once;
failures in a row open its breaker, which also ends the other awaits for its first
byte). A stream broken off after its first piece ends with an error event; any other
answer broken off after its first ``max_held_answer_bytes`` closes the client's
connection before its length. The load accounting of an attempt ends exactly once
however it ends. The decision goes to the debug log and the metrics, and out in the
``X-Kvatlas-Route`` header only to the operator (or everyone with
``--expose-route-header``).

Must not: parse or rewrite what an engine answers (beyond the error event of a broken
stream), or choose an engine.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final

import httpx
import msgspec
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvatlas.router.clients import EngineClients
from kvatlas.router.config import RouterConfig
from kvatlas.router.engines import EngineState
from kvatlas.router.health import fail_over
from kvatlas.router.metrics import RouterMetrics
from kvatlas.router.policy import Choice, Decision, Policy
from kvatlas.router.tiers import Tier
from kvatlas.router.tripwires import Tripped, Tripwires

log = logging.getLogger(__name__)

ROUTE_HEADER: Final = "x-kvatlas-route"
"""The answer's header naming the engine, the cached tokens expected, the tier they come
from (``tiers``), the reason, and the router's own time for this request (tokenize +
lookup + pick)."""
REQUEST_ID_HEADER: Final = "x-request-id"
HOP_BY_HOP: Final = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "host", "content-length",
    }
)  # fmt: skip


def error_body(message: str, kind: str) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": kind}})


@dataclass(frozen=True, slots=True)
class Plan:
    """One request's routing: the ranking, its reason, and where the time went."""

    decision: Decision
    policy: Policy
    prompt_tokens: int
    overhead_s: float
    blob: bytes = b""
    """The prompt's token ids as LE uint32 (empty when not tokenized)."""
    salt: str = ""
    """The ``cache_salt`` the request runs under: its lookups' and pending prefixes'."""
    tiers: Mapping[str, Tier] | None = None
    """Engine URL -> the tier its cached tokens come from."""


@dataclass(frozen=True, slots=True)
class Head:
    """What an attempt read of its answer before the client is sent anything."""

    resp: httpx.Response
    first: bytes
    """A stream's first piece; any other answer's whole body (raw, as it came)."""
    rest: AsyncIterator[bytes] | None
    """The answer's pieces after ``first``; None for a whole body."""
    stream: bool
    """An event stream (one broken off ends with an error event; any other answer cut
    short closes the client's connection before its promised length)."""


class Relay:
    """Attempts and relays (see the module doc); on the router's event loop."""

    def __init__(
        self,
        config: RouterConfig,
        clients: EngineClients,
        wires: Tripwires,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        *,
        count_tier: Callable[[Tier], None],
    ) -> None:
        self._config = config
        self._count_tier = count_tier
        """Counts each routing decision by the tier it was won by."""
        self._clients = clients
        self._wires = wires
        self._metrics = metrics
        self._clock = clock
        self.routed = 0
        """Requests relayed (``/v1/models`` aside)."""

    async def attempt(
        self,
        e: EngineState,
        choice: Choice,
        *,
        method: str,
        endpoint: str,
        body: bytes,
        headers: dict[str, str],
    ) -> Head | None:
        """Send to one engine and read its answer's head (`Head`); None after a
        failure before anything of it could go to the client, counted against the
        engine (one that ended because the engine is out, ``Tripped``, is not: the fault
        is counted once, by whoever found it)."""
        client = self._clients.get(e.url)
        rid = headers[REQUEST_ID_HEADER]
        e.begin(choice.prefill_tokens, sent := self._clock())
        resp: httpx.Response | None = None
        cause = ""
        try:
            req = client.build_request(method, endpoint, content=body, headers=headers)
            async with self._wires.arm(e.url, "first_byte"):
                resp = await client.send(req, stream=True)
                if resp.status_code < 500:
                    head = await read_head(resp, self._config.max_held_answer_bytes)
        except Tripped as exc:
            await self._abandon(e, choice, resp)
            self._metrics.retries.labels(e.url, exc.cause).inc()
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
                e.succeeded(self._clock())
                return head
            cause, detail = "5xx", f"answered {resp.status_code}"
        await self._abandon(e, choice, resp)
        self._metrics.retries.labels(e.url, cause).inc()
        if e.failed(detail, self._clock()):
            self._metrics.breaker_opens.labels(e.url).inc()
            log.warning(
                "router: breaker of engine %s opened after %d failures", e.url, e.breaker.failures
            )
            fail_over(self._wires, e, "breaker", streams=False)
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

    def respond(
        self,
        e: EngineState,
        choice: Choice,
        plan: Plan,
        head: Head,
        *,
        endpoint: str,
        rid: str,
        attempt: int,
        expose_route: bool = False,
    ) -> Response:
        """The client's answer: the engine's, as it comes (see the module doc), with the
        decision in ``X-Kvatlas-Route`` when ``expose_route`` (the operator's request, or
        ``--expose-route-header``): it names the cached tokens and their tier, what a
        client of a shared fleet must not learn of a prompt."""
        resp = head.resp
        reason = plan.decision.reason if attempt == 1 else f"{plan.decision.reason}; retry"
        tier = (plan.tiers or {}).get(e.url, "none")
        route = (
            f"engine={e.url}; cached={choice.cached_tokens}; tier={tier}; reason={reason};"
            f" overhead_ms={plan.overhead_s * 1000:.3f}"
        )
        if endpoint != "/v1/models":
            self.routed += 1
            self._metrics.decisions.labels(plan.policy, reason, e.url).inc()
            self._metrics.expected_cached.inc(choice.cached_tokens)
            self._count_tier(tier)
            log.debug(
                "router: request %s -> %s (prompt %d tokens, %d expected cached, %s,"
                " overhead %.2f ms)",
                rid, e.url, plan.prompt_tokens, choice.cached_tokens, reason,
                plan.overhead_s * 1000,
            )  # fmt: skip
        self._metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
        if head.rest is not None and not head.stream and "content-length" in resp.headers:
            headers["content-length"] = resp.headers["content-length"]  # relayed as it comes
        headers.pop(ROUTE_HEADER, None)
        if expose_route:
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
        self, e: EngineState, head: Head, rid: str, end: Callable[[], Awaitable[None]]
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
                async with self._wires.arm(e.url, "stream"):
                    try:
                        piece = await anext(rest)
                    except StopAsyncIteration:
                        break
                e.watch.piece(self._clock())
                yield piece
        except Tripped as exc:
            self._metrics.stream_failures.labels(e.url, exc.cause).inc()
            message = f"the engine {e.url} stopped answering ({exc.cause}); this answer is cut"
            log.warning("router: request %s: %s (%s)", rid, message, _ENDING[head.stream])
            if not head.stream:
                raise _CutShort from exc
            yield b"data: " + error_body(message, "upstream_error") + b"\n\n"
        except httpx.HTTPError as exc:
            self._metrics.stream_failures.labels(e.url, "broken").inc()
            # counted toward its breaker, not taken out: its next requests may answer
            e.failed(repr(exc), self._clock(), open_s=0.0)
            message = f"the engine {e.url} broke off this answer: {exc!r}"
            log.warning("router: request %s: %s (%s)", rid, message, _ENDING[head.stream])
            if not head.stream:
                raise _CutShort from exc
            yield b"data: " + error_body(message, "upstream_error") + b"\n\n"
        finally:
            await end()


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


async def read_head(resp: httpx.Response, hold: int) -> Head:
    """A stream's (``text/event-stream``) first piece; any other answer whole, or its
    first ``hold`` bytes or more and the rest of its pieces when it is longer."""
    pieces = resp.aiter_raw()
    if "text/event-stream" in resp.headers.get("content-type", ""):
        return Head(resp, await anext(pieces, b""), pieces, stream=True)
    held: list[bytes] = []
    size = 0
    async for piece in pieces:
        held.append(piece)
        size += len(piece)
        if size >= hold:
            return Head(resp, b"".join(held), pieces, stream=False)
    return Head(resp, b"".join(held), None, stream=False)
