"""The ``mooncake`` transport: Mooncake Transfer Engine, TCP here, RDMA in production
(``MC_TE_PROTOCOL=rdma`` and ``MC_TE_DEVICE``, read by ``MooncakeConfig.from_env``).

The owner initializes a Mooncake ``TransferEngine`` without a metadata server
(``P2PHANDSHAKE``), registers its whole region and advertises the session id
(host:rpc_port) and the region's base address. The requester registers its own region
once and reads with ``batch_transfer_sync_read`` into it, then verifies every op's
checksum: Mooncake has been seen to report success before the bytes landed.

Deadlines: Mooncake's Python calls block until the transfer ends or its own timeout
(``MC_TRANSFER_TIMEOUT``, at least 5 s) passes. Each batch therefore runs on its own
thread; ``read`` waits for it only until the deadline and reports the rest as timeouts.
A batch left running may still write into its local slots: ``drain`` waits for those
threads, and the caller must not reuse the slots of timed-out ops before it returns True.

One-sided: the owner's ``TransferEngine`` rejects addresses outside registered memory
but cannot check leases or a token (see ``kvatlas.transfer.base``). Mooncake listens on 0.0.0.0
whatever host it is given: keep it off untrusted networks, and in tests inside a private
network namespace.

Must not: issue writes to the peer (only READ batches are ever submitted).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

from mooncake.engine import TransferEngine

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
from kvatlas.transfer.config import MooncakeConfig
from kvatlas.transfer.errors import EndpointMismatch, TransportUnavailable

TRANSPORT = "mooncake"
BATCH_BYTES = 64 << 20
"""Bytes per submitted batch: a failure or timeout costs at most this much progress."""


def _start_te(config: MooncakeConfig, region: LocalMemory) -> tuple[Any, int]:
    # TransferEnginePy reads MC_TRANSFER_TIMEOUT in its constructor; the environment is
    # the only way in. An operator's own setting wins.
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(config.transfer_timeout_s))
    te = TransferEngine()
    rc = te.initialize(config.host, "P2PHANDSHAKE", config.protocol, config.device)
    if rc != 0:
        raise TransportUnavailable(
            f"mooncake initialize({config.host!r}, P2PHANDSHAKE, {config.protocol!r},"
            f" {config.device!r}) failed with {rc}"
        )
    address = region.address()
    rc = te.register_memory(address, region.size)
    if rc != 0:
        raise TransportUnavailable(f"mooncake register_memory of {region.size} bytes failed: {rc}")
    return te, address


class MooncakeServer(ConfiguredServer[MooncakeConfig]):
    transport: ClassVar[str] = TRANSPORT
    _te: Any = None
    _address = 0

    @classmethod
    def default_config(cls) -> MooncakeConfig:
        return MooncakeConfig()

    def start(self) -> Endpoint:
        if self._te is not None:
            raise TransportUnavailable("mooncake transfer server already started")
        self._te, self._address = _start_te(self.config, self._region)
        session = f"{self.config.host}:{self._te.get_rpc_port()}"
        return Endpoint(
            transport=TRANSPORT,
            url=f"mooncake://{session}",
            region_size=self._region.size,
            extra={
                "session_id": session,
                "base_address": str(self._address),
                "protocol": self.config.protocol,
            },
        )

    def stop(self) -> None:
        te, self._te = self._te, None
        if te is not None:
            te.unregister_memory(self._address)
            del te  # the TransferEngine's destructor stops its listener


class MooncakeClient(ConfiguredClient[MooncakeConfig]):
    transport: ClassVar[str] = TRANSPORT
    mc: Any
    """The requester's ``TransferEngine`` (None once closed)."""
    address: int
    """The local region's base address, as registered with it."""

    @classmethod
    def default_config(cls) -> MooncakeConfig:
        return MooncakeConfig()

    def _register_local(self) -> None:
        self.mc, self.address = _start_te(self.config, self.local)

    def connect(self, endpoint: Endpoint) -> MooncakePeer:
        endpoint.expect(TRANSPORT)
        if endpoint.extra.get("protocol", "tcp") != self.config.protocol:
            raise EndpointMismatch(
                f"peer {endpoint.url!r} speaks {endpoint.extra.get('protocol')!r},"
                f" this transport {self.config.protocol!r}"
            )
        base = endpoint.extra.get("base_address", "")
        if not base.isdigit() or not endpoint.extra.get("session_id"):
            raise EndpointMismatch(f"mooncake endpoint {endpoint.url!r} lacks its session")
        return self._track(MooncakePeer(self, endpoint, endpoint.extra["session_id"], int(base)))

    def _release(self, peers: list[PeerConnection]) -> None:
        # Unregistering under a transfer still writing would be unsafe: wait for them.
        drained = all(peer.drain(self.config.transfer_timeout_s + 5) for peer in peers)
        if drained and self.mc is not None:
            self.mc.unregister_memory(self.address)
        self.mc = None


class _Batch:
    """One blocking batch call on its own thread."""

    def __init__(self, call: Any, args: tuple[Any, ...]) -> None:
        self.rc: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call, args), daemon=True)
        self.thread.start()

    def _run(self, call: Any, args: tuple[Any, ...]) -> None:
        try:
            self.rc = int(call(*args))
        except Exception as exc:  # reported as a failed op, never lost
            self.error = exc


class MooncakePeer(PeerConnection):
    client: MooncakeClient

    def __init__(self, client: MooncakeClient, endpoint: Endpoint, session: str, base: int):
        super().__init__(client, endpoint)
        self._session = session
        self._base = base
        self._running: list[_Batch] = []
        self._lock = threading.Lock()

    def _read(
        self,
        ops: Sequence[ReadOp],
        todo: list[int],
        results: dict[int, ReadResult],
        deadline: Deadline,
    ) -> None:
        client = self.client
        for batch in _split(ops, todo, BATCH_BYTES):
            if client.mc is None:
                status: tuple[ReadStatus, str] | None = (ReadStatus.PEER_DEAD, "client closed")
            else:
                status = self._run_batch(ops, batch, deadline)
            if status is not None:
                code, detail = status
                for i in todo[todo.index(batch[0]) :]:
                    results[i] = ReadResult(ops[i], code, detail)
                break
            for i in batch:
                results[i] = client.verify(ops[i])

    def _run_batch(
        self, ops: Sequence[ReadOp], batch: list[int], deadline: Deadline
    ) -> tuple[ReadStatus, str] | None:
        """None when the batch completed; otherwise the status of every op from here on."""
        remaining = deadline.remaining()
        if remaining <= 0:
            return ReadStatus.TIMEOUT, "deadline passed before the transfer started"
        client = self.client
        local = [client.address + ops[i].local_offset for i in batch]
        remote = [self._base + ops[i].remote_offset for i in batch]
        sizes = [ops[i].size for i in batch]
        job = _Batch(client.mc.batch_transfer_sync_read, (self._session, local, remote, sizes))
        job.thread.join(remaining)
        if job.thread.is_alive():
            with self._lock:
                self._running.append(job)
            return ReadStatus.TIMEOUT, "deadline passed during the mooncake transfer"
        if job.error is not None:
            return ReadStatus.PEER_DEAD, f"mooncake transfer raised {job.error!r}"
        if job.rc != 0:
            return ReadStatus.PEER_DEAD, f"mooncake transfer failed with {job.rc}"
        return None

    def drain(self, timeout_s: float) -> bool:
        deadline = Deadline(timeout_s)
        with self._lock:
            running = list(self._running)
        for job in running:
            job.thread.join(max(0.0, deadline.remaining()))
        with self._lock:
            self._running = [j for j in self._running if j.thread.is_alive()]
            return not self._running

    def close(self) -> None:
        return None  # Mooncake keeps one segment handle per session inside the TransferEngine


def _split(ops: Sequence[ReadOp], todo: list[int], limit: int) -> list[list[int]]:
    batches: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in todo:
        if current and size + ops[i].size > limit:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += ops[i].size
    if current:
        batches.append(current)
    return batches
