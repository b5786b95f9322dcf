"""The ``nixl`` transport: NIXL with its UCX backend over DRAM descriptors.

The owner creates an agent, registers its whole region and advertises the agent's
metadata (base64) with the region's descriptor (base address, size, DRAM, device 0).
The requester creates one agent, registers its own region once, adds each peer's agent
from the endpoint and reads with a READ transfer request built from two prepped
descriptor lists (local slots, remote ranges), then verifies every op's checksum.

UCX settings: ``UCX_TLS=tcp,cma,self`` and ``UCX_NET_DEVICES=lo`` unless the environment
already sets them (on one host UCX then reads with CMA, ``process_vm_readv``).

Progress without spinning: NIXL's progress thread polls with no delay and keeps a core
busy in an idle process, so no agent here runs one. The requester drives progress by
polling the transfer's state, sleeping between polls (20 us doubling to
``poll_max_sleep_s``); the owner, whose transport must answer connection setup from new
peers, drives it from one thread every ``progress_interval_s`` (a small fraction of a
core when idle). Reads themselves need no owner CPU.

One-sided: the owner's agent rejects ranges outside registered memory (prepping such a
descriptor fails, reported as refused) but cannot check leases or a token (see
``kvatlas.transfer.base``).

Must not: issue WRITE requests, or create an agent with NIXL's progress thread.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from kvatlas.runtime.periodic import Periodic
from kvatlas.transfer.base import (
    ConfiguredClient,
    ConfiguredServer,
    Deadline,
    Endpoint,
    LocalMemory,
    PeerConnection,
    ReadOp,
    ReadResult,
    ReadStatus,
)
from kvatlas.transfer.config import NixlConfig
from kvatlas.transfer.errors import EndpointMismatch, TransportUnavailable


def _load_api() -> Any:
    """NIXL's Python API: ``nixl`` (the meta package) or ``nixl_cu12`` (the wheel itself).
    Loaded by name so that mypy treats it as untyped instead of checking NIXL's code."""
    for name in ("nixl._api", "nixl_cu12"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("neither nixl nor nixl_cu12 is installed")


_api = _load_api()

TRANSPORT = "nixl"
_POLL_MIN_SLEEP_S = 20e-6


def _make_agent(config: NixlConfig, role: str) -> Any:
    # UCX reads its environment when the backend is created; an operator's setting wins.
    os.environ.setdefault("UCX_TLS", config.ucx_tls)
    os.environ.setdefault("UCX_NET_DEVICES", config.ucx_net_devices)
    name = f"kvatlas-{role}-{os.getpid()}-{secrets.token_hex(4)}"
    conf = _api.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
    )
    try:
        agent = _api.nixl_agent(name, conf)
    except Exception as exc:
        raise TransportUnavailable(f"cannot create a NIXL agent with UCX: {exc}") from exc
    if "UCX" not in agent.backends:
        raise TransportUnavailable("NIXL has no UCX backend here (UCX_TLS needs tcp or cma)")
    return agent


def _register(agent: Any, region: LocalMemory) -> tuple[Any, int]:
    address = region.address()
    try:
        descs = agent.register_memory([(address, region.size, 0, "")], "DRAM")
    except Exception as exc:
        raise TransportUnavailable(f"NIXL cannot register {region.size} bytes: {exc}") from exc
    return descs, address


class NixlServer(ConfiguredServer[NixlConfig]):
    transport: ClassVar[str] = TRANSPORT
    _agent: Any = None
    _descs: Any = None
    _ticker: Periodic | None = None

    @classmethod
    def default_config(cls) -> NixlConfig:
        return NixlConfig()

    def start(self) -> Endpoint:
        if self._agent is not None:
            raise TransportUnavailable("nixl transfer server already started")
        agent = _make_agent(self.config, "owner")
        self._descs, address = _register(agent, self._region)
        self._agent = agent
        metadata = agent.get_agent_metadata()
        # The only thread that touches the agent after start() (its sync mode is NONE).
        self._ticker = Periodic(
            "kvatlas-nixl",
            self.config.progress_interval_s,
            agent.get_new_notifs,
            what="NIXL's progress (its notifications)",
        )
        self._ticker.start()
        return Endpoint(
            transport=TRANSPORT,
            url=f"nixl://{agent.name}",
            region_size=self._region.size,
            extra={
                "agent_name": agent.name,
                "agent_metadata": base64.b64encode(metadata).decode(),
                "base_address": str(address),
                "mem_type": "DRAM",
                "device_id": "0",
            },
        )

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.deregister_memory(self._descs)


class NixlClient(ConfiguredClient[NixlConfig]):
    transport: ClassVar[str] = TRANSPORT
    agent: Any
    """The requester's agent (None once closed)."""
    address: int
    """The local region's base address, as registered with it."""
    lock: threading.Lock
    """The agent runs without NIXL's own locking: every call on it holds this."""

    @classmethod
    def default_config(cls) -> NixlConfig:
        return NixlConfig()

    def _register_local(self) -> None:
        self.lock = threading.Lock()
        self.agent = _make_agent(self.config, "reader")
        self._descs, self.address = _register(self.agent, self.local)

    def connect(self, endpoint: Endpoint) -> NixlPeer:
        endpoint.expect(TRANSPORT)
        extra = endpoint.extra
        if extra.get("mem_type", "DRAM") != "DRAM" or not extra.get("base_address", "").isdigit():
            raise EndpointMismatch(f"nixl endpoint {endpoint.url!r} lacks a DRAM region")
        try:
            metadata = base64.b64decode(extra["agent_metadata"])
            with self.lock:
                name = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise EndpointMismatch(f"bad nixl agent metadata in {endpoint.url!r}: {exc}") from exc
        return self._track(NixlPeer(self, endpoint, name, int(extra["base_address"])))

    def _release(self, peers: list[PeerConnection]) -> None:
        with self.lock:
            if self.agent is not None:
                self.agent.deregister_memory(self._descs)
                self.agent = None


class NixlPeer(PeerConnection):
    client: NixlClient

    def __init__(self, client: NixlClient, endpoint: Endpoint, name: Any, base: int):
        super().__init__(client, endpoint)
        self._name = name
        self._base = base
        self._abandoned: list[Any] = []
        """Transfer handles that timed out and could not be released yet."""

    def _read(
        self,
        ops: Sequence[ReadOp],
        todo: list[int],
        results: dict[int, ReadResult],
        deadline: Deadline,
    ) -> None:
        failure = self._transfer([ops[i] for i in todo], deadline)
        for i in todo:
            results[i] = ReadResult(ops[i], *failure) if failure else self.client.verify(ops[i])

    def _transfer(self, ops: Sequence[ReadOp], deadline: Deadline) -> tuple[ReadStatus, str] | None:
        """Run one READ request for all ``ops``; None when it completed."""
        client = self.client
        local = [(client.address + op.local_offset, op.size, 0) for op in ops]
        remote = [(self._base + op.remote_offset, op.size, 0) for op in ops]
        indices = list(range(len(ops)))
        handles: list[Any] = []
        with client.lock:
            agent = client.agent
            if agent is None:
                return ReadStatus.PEER_DEAD, "the nixl client is closed"
            try:
                handles.append(agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"))
                handles.append(agent.prep_xfer_dlist(self._name, remote, "DRAM"))
            except Exception as exc:
                self._release(agent, handles)
                return ReadStatus.REFUSED, f"the peer's agent refused the ranges: {exc!r}"
            try:
                xfer = agent.make_prepped_xfer("READ", handles[0], indices, handles[1], indices)
                state = agent.transfer(xfer)
            except Exception as exc:
                self._release(agent, handles)
                return ReadStatus.PEER_DEAD, f"nixl could not post the read: {exc!r}"
        sleep = _POLL_MIN_SLEEP_S
        try:
            while state == "PROC":
                remaining = deadline.remaining()
                if remaining <= 0:
                    break
                time.sleep(min(sleep, remaining))
                sleep = min(sleep * 2, client.config.poll_max_sleep_s)
                with client.lock:
                    state = agent.check_xfer_state(xfer)
        except Exception as exc:
            state = "ERR"
            detail = f"nixl transfer failed: {exc!r}"
        else:
            detail = "nixl reported a failed transfer"
        with client.lock:
            if state == "PROC" and not self._try_release(xfer):
                self._abandoned.append(xfer)
            elif state != "PROC":
                self._try_release(xfer)
            self._release(agent, handles)
        if state == "DONE":
            return None
        if state == "PROC":
            return ReadStatus.TIMEOUT, "deadline passed during the nixl transfer"
        return ReadStatus.PEER_DEAD, detail

    @staticmethod
    def _try_release(xfer: Any) -> bool:
        try:
            xfer.release()  # aborts a transfer still in progress where the backend can
        except Exception:
            return False
        return True

    @staticmethod
    def _release(agent: Any, handles: list[Any]) -> None:
        for handle in handles:
            agent.release_dlist_handle(handle)

    def drain(self, timeout_s: float) -> bool:
        deadline = Deadline(timeout_s)
        while True:
            with self.client.lock:
                self._abandoned = [x for x in self._abandoned if not self._try_release(x)]
                if not self._abandoned:
                    return True
            if deadline.expired():
                return False
            time.sleep(0.001)

    def close(self) -> None:
        with self.client.lock:
            if self.client.agent is not None:
                # Already gone: nothing else to release.
                with contextlib.suppress(Exception):
                    self.client.agent.remove_remote_agent(self._name)


__all__ = ["NixlClient", "NixlPeer", "NixlServer"]
