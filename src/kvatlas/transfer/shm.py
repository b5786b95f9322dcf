"""The ``shm`` transport: same-host peers map the owner's L1 region read-only and copy.

The owner advertises its region's shared-memory name and size, its pid and the host's
boot id. The requester maps ``/dev/shm/<name>`` with ``mmap.ACCESS_READ`` (so it can never
write into the peer's memory) and copies each op with ``np.copyto`` into its own region,
then verifies the checksum.

One-sided: the owner is not involved in a read, so leases are enforced at the control
plane (the controller only reads ranges ``lookup_and_lock`` returned) and by the checksum;
this transport enforces only the region boundary. /dev/shm file permissions (owner's uid,
mode 0600) are what keeps other users out; the token plays no part.

The mapping is ``kvatlas.runtime.region.L1Region.attach`` read-only (an mmap of
/dev/shm, never ``SharedMemory``, whose resource tracker would unlink the owner's region
when this process exits), with the page tables of the whole region populated once at
connect: otherwise every first read of a range pays a fault per 4 KiB page, which slows a
large prefix read noticeably; the tables cost a small fraction of the region.

A read of several ops copies them on ``COPY_THREADS`` threads (one op each at a time:
copy and xxh3 fused in cache-sized blocks, both releasing the GIL), so that one core's
copy does not bound a many-chunk prefix when the machine has another core free.

A dead owner: its mapping stays readable here, but the lease it granted died with it, so
reads report ``peer_dead`` once a pidfd of the owner says it exited.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from kvatlas.core.checksum import copy_and_checksum
from kvatlas.core.errors import InvalidInput
from kvatlas.runtime.region import SHM_DIR, L1Region, RegionBusy, RegionError
from kvatlas.transfer.base import (
    Deadline,
    Endpoint,
    FaultPlan,
    LocalMemory,
    OneSidedServer,
    PeerConnection,
    ReadOp,
    ReadResult,
    ReadStatus,
    TransferClient,
)
from kvatlas.transfer.errors import EndpointMismatch, TransportUnavailable

TRANSPORT = "shm"
LIVENESS_INTERVAL_S = 0.005
"""How often a long read checks that the owner still lives (a select() on its pidfd)."""
COPY_THREADS = 2
"""Threads that copy and verify the ops of one read in parallel (per client, started at
the first read of more than one op). Two: a copy is memory-bound, so more threads gain
little on the hosts here, and the engine and the owner need cores too."""


def boot_id() -> str:
    """Identifies this host's current boot: peers with another one are not on this host."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process' pid namespace: a peer's pid means something here only when equal."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


class ShmServer(OneSidedServer):
    transport: ClassVar[str] = TRANSPORT

    def start(self) -> Endpoint:
        name = self._region.name
        if not name or not (SHM_DIR / name).exists():
            raise TransportUnavailable(
                f"the shm transport needs an L1 region in /dev/shm; region {name!r} is not one"
            )
        return Endpoint(
            transport=TRANSPORT,
            url=f"shm://{name}",
            region_size=self._region.size,
            extra={"boot_id": boot_id(), "pid": str(os.getpid()), "pid_ns": pid_namespace()},
        )

    def stop(self) -> None:
        return None


class ShmClient(TransferClient):
    transport: ClassVar[str] = TRANSPORT

    def __init__(
        self,
        local: LocalMemory,
        peer_id: str,
        *,
        token: str | None = None,
        faults: FaultPlan | None = None,
    ) -> None:
        super().__init__(local, peer_id, token=token, faults=faults)
        self._local_array: npt.NDArray[np.uint8] | None = np.frombuffer(
            local.buffer, dtype=np.uint8
        )
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor:
        """The copy threads (started on first use)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="shm-copy")
            return self._pool

    @property
    def local_array(self) -> npt.NDArray[np.uint8]:
        if self._local_array is None:
            raise TransportUnavailable("shm transfer client is closed")
        return self._local_array

    def connect(self, endpoint: Endpoint) -> ShmPeer:
        endpoint.expect(TRANSPORT)
        if endpoint.extra.get("boot_id") != boot_id():
            raise EndpointMismatch(f"shm endpoint {endpoint.url!r} is on another host")
        return self._track(ShmPeer(self, endpoint))

    def _release(self, peers: list[PeerConnection]) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._local_array = None


class ShmPeer(PeerConnection):
    client: ShmClient

    def __init__(self, client: ShmClient, endpoint: Endpoint) -> None:
        super().__init__(client, endpoint)
        name = endpoint.url.removeprefix("shm://")
        try:
            region = L1Region.attach(name, endpoint.region_size, readonly=True)
        except InvalidInput as exc:
            raise EndpointMismatch(f"bad shm endpoint {endpoint.url!r}: {exc}") from exc
        except RegionError as exc:
            raise TransportUnavailable(f"cannot attach the peer's region: {exc}") from exc
        self._region: L1Region | None = region
        self._remote: npt.NDArray[np.uint8] | None = region.array
        same_ns = endpoint.extra.get("pid_ns") == pid_namespace() != ""
        self._pidfd = _pidfd(endpoint.extra.get("pid", "")) if same_ns else None
        self._lock = threading.Lock()  # guards the pidfd and the liveness answer
        self._alive = True
        self._checked = float("-inf")

    def _read(
        self,
        ops: Sequence[ReadOp],
        todo: list[int],
        results: dict[int, ReadResult],
        deadline: Deadline,
    ) -> None:
        with self._lock:
            self._checked = float("-inf")  # every read asks about the owner at least once
        # The fault plan counts ops in order, whichever thread verifies them first.
        corrupt = [self.client.faults.corrupt_next() for _ in todo]
        if len(todo) == 1:
            results[todo[0]] = self._copy(ops[todo[0]], deadline, corrupt[0])
            return
        pool = self.client.pool()
        futures = [
            pool.submit(self._copy, ops[i], deadline, bad)
            for i, bad in zip(todo, corrupt, strict=True)
        ]
        for i, future in zip(todo, futures, strict=True):
            results[i] = future.result()

    def _copy(self, op: ReadOp, deadline: Deadline, corrupt: bool) -> ReadResult:
        """Copy and verify one op (a copy thread, or the caller for a single op)."""
        remote = self._remote
        if remote is None or not self._owner_alive():
            return ReadResult(op, ReadStatus.PEER_DEAD, "the owner process exited")
        if deadline.expired():
            return ReadResult(op, ReadStatus.TIMEOUT, "deadline passed")
        lo, ro, n = op.local_offset, op.remote_offset, op.size
        digest = copy_and_checksum(remote[ro : ro + n], self.client.local_array[lo : lo + n])
        return self.client.verify_digest(op, digest, corrupt)

    def _owner_alive(self) -> bool:
        """False once the owner's pidfd says it exited (asked at most every
        ``LIVENESS_INTERVAL_S``; the copy threads share the answer)."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked <= LIVENESS_INTERVAL_S:
                return self._alive
            self._checked = now
            if self._pidfd is not None:
                readable, _, _ = select.select([self._pidfd], [], [], 0)
                self._alive = not readable  # a pidfd turns readable when the process exits
            return self._alive

    def close(self) -> None:
        with self._lock:
            self._remote = None
            if self._region is not None:
                # A read in another thread may still hold a view; then it unmaps on GC.
                with contextlib.suppress(RegionBusy):
                    self._region.close()
                self._region = None
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None


def _pidfd(pid: str) -> int | None:
    """A pidfd of the owner (immune to pid reuse); None when it cannot be opened."""
    if not pid.isdigit():
        return None
    try:
        return os.pidfd_open(int(pid))
    except ProcessLookupError:
        # Already gone: an fd that is always readable keeps the check uniform.
        r, w = os.pipe()
        os.close(w)
        return r
    except OSError:
        return None
