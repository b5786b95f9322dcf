"""`AsyncLookups` (the router's per-request lookup from its event loop) against real
coordinators on 127.0.0.1 and replicas that fail as real ones do: the same holders as
the synchronous client's lookup, over kept-alive connections; the owning client's
replica order, failover and breakers; a connection the replica closed while idle is
retried once, not counted as a failure; the call's deadline bounds every replica
together; the fleet's token goes out, and a 4xx is an answer, never a failover."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvatlas.core.types import Incarnation, InstanceId
from kvatlas.launch.procs import free_port
from kvatlas.runtime.coordinator_client import (
    AsyncLookups,
    CoordinatorClient,
    CoordinatorRefused,
    CoordinatorUnreachable,
    Failover,
)
from kvatlas.wire.directory_api import HolderWire, LookupRequest
from kvatlas.wire.instances_api import RegisterRequest
from support.coordinator import RunningCoordinator

from .events import MODEL, batch, prompt_hashes
from .test_client_failover import unavailable

__all__ = ["unavailable"]  # the fixture, imported for this module's tests

Start = Callable[..., RunningCoordinator]
TOKENS = list(range(3 * 256 + 17))
BLOB = np.asarray(TOKENS, dtype="<u4").tobytes()


def register(client: CoordinatorClient, iid: str) -> None:
    client.register(
        RegisterRequest(
            ip="127.0.0.1", http_port=7555, instance_id=InstanceId(iid), incarnation=Incarnation(1)
        )
    )


def fill(client: CoordinatorClient) -> None:
    """node-a holds the prompt's 3 chunks, node-b its first."""
    register(client, "node-a")
    register(client, "node-b")
    hashes = prompt_hashes(TOKENS[: 3 * 256])
    client.post_events([batch("node-a", 1, hashes), batch("node-b", 1, hashes[:1])])


def by_instance(holders: list[HolderWire]) -> dict[tuple[str, str], tuple[int, int]]:
    return {(h.instance_id, h.tier): (h.chunks, h.tokens) for h in holders}


def lookup_once(client: CoordinatorClient) -> list[HolderWire]:
    """One lookup of the prompt on a new ``AsyncLookups``, closed after."""

    async def go() -> list[HolderWire]:
        lookups = client.async_lookups()
        try:
            return (await lookups.holders(BLOB, MODEL, timeout_s=5.0)).holders
        finally:
            await lookups.aclose()

    return asyncio.run(go())


@pytest.fixture
def frozen() -> Iterator[str]:
    """A replica that accepts connections and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_the_holders_are_the_sync_lookups_over_one_kept_connection(
    start_coordinator: Start,
) -> None:
    coord = start_coordinator()
    with CoordinatorClient(coord.url, timeout_s=5.0) as client:
        fill(client)
        sync = client.lookup(LookupRequest(token_ids=TOKENS, model_name=MODEL))
        expected = by_instance(sync.prefix_holders)
        assert expected == {("node-a", "l1"): (3, 768), ("node-b", "l1"): (1, 256)}

        async def go(lookups: AsyncLookups) -> None:
            for _ in range(3):
                answer = await lookups.holders(BLOB, MODEL, timeout_s=5.0)
                assert by_instance(answer.holders) == expected
                assert answer.server_s is not None and 0 < answer.server_s < 5.0
            together = await asyncio.gather(
                *(lookups.holders(BLOB, MODEL, timeout_s=5.0) for _ in range(12))
            )
            assert all(by_instance(a.holders) == expected for a in together)
            # a prefix nobody holds, and another model: no holders, not an error
            other = await lookups.holders(BLOB[4:], MODEL, timeout_s=5.0)
            assert other.holders == []
            assert (await lookups.holders(BLOB, "no-such-model", timeout_s=5.0)).holders == []
            await lookups.aclose()

        asyncio.run(go(client.async_lookups()))
        assert client.stats().failovers == 0 and client.stats().replicas[0].failures == 0


def test_a_connection_closed_while_idle_is_retried_not_failed(start_coordinator: Start) -> None:
    port = free_port()
    first = start_coordinator(port=port)
    with CoordinatorClient(first.url, timeout_s=5.0) as client:
        fill(client)

        async def go() -> tuple[list[HolderWire], list[HolderWire]]:
            lookups = client.async_lookups()
            before = (await lookups.holders(BLOB, MODEL, timeout_s=5.0)).holders
            # the replica restarts (without its state): the kept connection is dead
            await asyncio.to_thread(first.stop)
            await asyncio.to_thread(start_coordinator, port=port)
            after = (await lookups.holders(BLOB, MODEL, timeout_s=5.0)).holders
            await lookups.aclose()
            return before, after

        before, after = asyncio.run(go())
        assert len(before) == 2 and after == []  # the new replica knows nothing yet
        assert client.stats().replicas[0].failures == 0


def _errors(reason: str) -> dict[str, str]:
    """A failover's reason (``url: error; url: error``) as base URL -> error."""
    parts = (part.split(": ", 1) for part in reason.split("; "))
    return {url.rsplit("/", 2)[0]: error for url, error in parts}


def test_failover_is_the_owning_clients(start_coordinator: Start, frozen: str) -> None:
    live = start_coordinator()
    dead = f"http://127.0.0.1:{free_port()}"
    events: list[Failover] = []
    with CoordinatorClient(
        [dead, frozen, live.url], timeout_s=0.5, on_failover=events.append
    ) as client:

        async def go() -> float:
            lookups = client.async_lookups()
            t0 = time.monotonic()
            first = await lookups.holders(BLOB, MODEL, timeout_s=5.0)
            took = time.monotonic() - t0
            assert first.holders == []
            for _ in range(5):
                await lookups.holders(BLOB, MODEL, timeout_s=5.0)
            await lookups.aclose()
            return took

        took = asyncio.run(go())
        # the frozen replica cost one per-replica deadline: its own 0.5 s timeout fired
        # (not the call's 5 s, which then left the live replica time to answer)
        [event] = events
        assert (event.from_url, event.to_url) == (dead, live.url)
        errors = _errors(event.reason)
        assert errors.keys() == {dead, frozen}, event.reason
        assert errors[frozen] == "TimeoutError()" and "Refused" in errors[dead], errors
        assert took >= 0.5, took  # a lower bound: load only lengthens it
        # and it is not asked again: it would time out again, a second failure
        st = client.stats()
        assert st.url == live.url and st.failovers == 1
        assert [r.failures for r in st.replicas] == [1, 1, 0]
        # the synchronous calls go where the lookups went
        fill(client)
    assert sorted(live.instance_ids()) == ["node-a", "node-b"]


HANG_S = 15.0
"""Half a per-replica timeout (30 s) below: a call that the call's deadline did not end."""


def test_the_calls_deadline_bounds_every_replica_together(frozen: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as other:
        second = f"http://127.0.0.1:{other.getsockname()[1]}"
        with CoordinatorClient([frozen, second], timeout_s=30.0) as client:

            async def go() -> None:
                lookups = client.async_lookups()
                try:
                    await lookups.holders(BLOB, MODEL, timeout_s=0.4)
                finally:
                    await lookups.aclose()

            t0 = time.monotonic()
            with pytest.raises(CoordinatorUnreachable) as info:
                asyncio.run(go())
            assert time.monotonic() - t0 < HANG_S
            # the 0.4 s deadline ended the first replica's attempt, and left none to the
            # second: it was never asked
            assert frozen in str(info.value) and "TimeoutError()" in str(info.value)
            assert second not in str(info.value), str(info.value)
            assert [r.failures for r in client.stats().replicas] == [1, 0]


def test_a_5xx_fails_over_naming_it(start_coordinator: Start, unavailable: str) -> None:
    live = start_coordinator()
    with CoordinatorClient([unavailable, live.url], timeout_s=2.0) as client:
        assert lookup_once(client) == []
        assert client.url == live.url and client.stats().failovers == 1
    with CoordinatorClient([unavailable], timeout_s=2.0) as client:
        with pytest.raises(CoordinatorRefused) as info:
            lookup_once(client)
        assert info.value.status == 503 and info.value.reason == "catching up on the log"


def test_the_token_goes_out_and_a_4xx_is_no_failover(start_coordinator: Start) -> None:
    a = start_coordinator(auth_token="s3cret-token-of-the-fleet")
    b = start_coordinator(auth_token="s3cret-token-of-the-fleet")
    with CoordinatorClient(
        [a.url, b.url], auth_token="s3cret-token-of-the-fleet", timeout_s=2.0
    ) as client:
        fill(client)
        assert len(lookup_once(client)) == 2
    with CoordinatorClient([a.url, b.url], auth_token="wrong", timeout_s=2.0) as client:
        with pytest.raises(CoordinatorRefused) as info:
            lookup_once(client)
        assert info.value.status == 401
        assert client.url == a.url and client.stats().failovers == 0
