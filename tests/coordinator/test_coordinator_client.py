"""`CoordinatorClient` against a real coordinator on 127.0.0.1: every call decodes into
the Structs the coordinator encodes, and every failure leaves the client as its own
exception tree (unreachable, refused with the coordinator's reason, unknown instance,
an answer of the wrong shape)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvatlas.core.types import Incarnation, InstanceId, Tier
from kvatlas.launch.procs import free_port
from kvatlas.runtime.coordinator_client import (
    BadAnswer,
    CoordinatorClient,
    CoordinatorError,
    CoordinatorRefused,
    CoordinatorUnreachable,
    UnknownInstance,
)
from kvatlas.wire.coordinator_views import ReadyResponse
from kvatlas.wire.directory_api import LookupRequest
from kvatlas.wire.events_api import EventsResponse
from kvatlas.wire.http_api import KeyWire
from kvatlas.wire.instances_api import ContractWire, RegisterRequest, RegisterResponse
from support.coordinator import RunningCoordinator

from .events import MODEL, RANK, batch, fake_hash, key, prompt_hashes


def register_request(
    iid: str, *, p2p_advertised_url: str | None = None, contract: ContractWire | None = None
) -> RegisterRequest:
    return RegisterRequest(
        ip="127.0.0.1",
        http_port=7555,
        instance_id=InstanceId(iid),
        p2p_advertised_url=p2p_advertised_url,
        incarnation=Incarnation(1),
        contract=contract,
    )


@pytest.fixture
def client(coord: RunningCoordinator) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(coord.url, timeout_s=10.0) as c:
        yield c


def test_membership_calls_round_trip_through_the_typed_shapes(client: CoordinatorClient) -> None:
    answer = client.register(register_request("node-a", p2p_advertised_url="127.0.0.1:9000"))
    assert answer == RegisterResponse("node-a", re_registered=False, incarnation=1)
    listed = client.instances()
    assert [(i.instance_id, i.incarnation, i.p2p_advertised_url) for i in listed] == [
        ("node-a", 1, "127.0.0.1:9000")
    ]
    client.heartbeat("node-a")
    assert client.register(register_request("node-a")).re_registered
    client.deregister("node-a")
    assert client.instances() == []


def test_a_heartbeat_the_coordinator_does_not_know_is_unknown_instance(
    client: CoordinatorClient,
) -> None:
    with pytest.raises(UnknownInstance) as info:
        client.heartbeat("never-registered")
    assert info.value.status == 404
    assert info.value.reason == "unknown instance never-registered; re-register"
    assert isinstance(info.value, CoordinatorRefused)
    assert "/instances/never-registered/heartbeat answered 404" in str(info.value)


def test_events_lookups_and_stats(client: CoordinatorClient) -> None:
    client.register(register_request("node-a"))
    client.register(register_request("node-b"))
    tokens = list(range(3 * 256))
    hashes = prompt_hashes(tokens)
    first = client.post_events([batch("node-a", 1, hashes)])
    assert first == EventsResponse(applied=1, duplicates=0, stale=0)
    again = client.post_events([batch("node-a", 1, hashes)], fmt="json")
    assert (again.applied, again.duplicates) == (0, 1)
    assert client.post_events([batch("node-b", 1, hashes[:1])], fmt="json").applied == 1

    by_keys = client.lookup(LookupRequest(keys=[KeyWire.from_core(key(h)) for h in hashes]))
    assert by_keys.chunks == 3
    assert [sorted(p.instance_id for p in r.placements) for r in by_keys.results] == [
        ["node-a", "node-b"],
        ["node-a"],
        ["node-a"],
    ]
    by_tokens = client.lookup(LookupRequest(token_ids=tokens, model_name=MODEL, kv_rank=RANK))
    assert [r.key.chunk_hash_hex for r in by_tokens.results] == [h.hex() for h in hashes]
    holders = {(h.instance_id, h.tier): h.chunks for h in by_tokens.prefix_holders}
    assert holders == {("node-a", "l1"): 3, ("node-b", "l1"): 1}

    stats = client.directory_stats()
    assert (stats.keys, stats.live_instances, stats.digest) == (3, 2, None)
    owners = {(o.instance_id, o.tier): o.placements for o in stats.owners}
    assert owners == {("node-a", Tier.L1.value): 3, ("node-b", Tier.L1.value): 1}
    assert [(c.instance_id, c.last_seq) for c in stats.cursors] == [("node-a", 1), ("node-b", 1)]
    assert client.directory_stats(digest=True).digest
    assert client.ready() == ReadyResponse(True, "")


def test_a_refusal_carries_the_status_and_the_coordinators_reason(
    client: CoordinatorClient,
) -> None:
    fleet = ContractWire("llama", kv_dtype="float16")
    client.register(register_request("node-a", contract=fleet))
    other = ContractWire("llama", kv_dtype="bfloat16")
    with pytest.raises(CoordinatorRefused) as info:
        client.register(register_request("node-b", contract=other))
    assert info.value.status == 409
    assert "kv_dtype" in info.value.reason and info.value.reason in str(info.value)
    assert not isinstance(info.value, UnknownInstance)
    with pytest.raises(CoordinatorRefused) as bad:
        client.lookup(LookupRequest(token_ids=[1, 2, 3]))  # no model_name
    assert (bad.value.status, bad.value.reason) == (400, "model_name is required with token_ids")


def test_the_bearer_token_goes_out_on_every_call(
    start_coordinator: Callable[..., RunningCoordinator],
) -> None:
    rc = start_coordinator(auth_token="s3cret")
    with CoordinatorClient(rc.url) as anonymous:
        with pytest.raises(CoordinatorRefused) as info:
            anonymous.instances()
        assert info.value.status == 401 and "bearer token" in info.value.reason
    with CoordinatorClient(rc.url, auth_token="s3cret") as member:
        member.register(register_request("node-a"))
        member.heartbeat("node-a")
        assert [i.instance_id for i in member.instances()] == ["node-a"]
        assert member.post_events([batch("node-a", 1, [fake_hash(1)])]).applied == 1


def test_an_unreachable_coordinator_is_coordinator_unreachable() -> None:
    with CoordinatorClient(f"http://127.0.0.1:{free_port()}", timeout_s=2.0) as client:
        with pytest.raises(CoordinatorUnreachable) as info:
            client.register(register_request("node-a"))
        assert info.value.status == 0
        assert isinstance(info.value.__cause__, httpx.ConnectError)
        with pytest.raises(CoordinatorUnreachable):
            client.heartbeat("node-a")
        with pytest.raises(CoordinatorUnreachable):
            client.post_events([batch("node-a", 1, [fake_hash(1)])])


def test_a_silent_coordinator_costs_the_lookups_own_deadline() -> None:
    """A peer that accepts and never answers: the per-call timeout bounds the lookup,
    below the client's own."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with CoordinatorClient(url, timeout_s=30.0) as client:
            t0 = time.monotonic()
            with pytest.raises(CoordinatorUnreachable) as info:
                client.lookup(LookupRequest(keys=[]), timeout_s=0.3)
            assert time.monotonic() - t0 < 5.0
            assert isinstance(info.value.__cause__, httpx.TimeoutException)


class _NotACoordinator(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"instances": "not a list"}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


def test_an_answer_of_the_wrong_shape_is_bad_answer() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotACoordinator)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with CoordinatorClient(url) as client, pytest.raises(BadAnswer) as info:
            client.instances()
        assert info.value.status == 200 and "InstancesResponse" in str(info.value)
        assert isinstance(info.value, CoordinatorError)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
