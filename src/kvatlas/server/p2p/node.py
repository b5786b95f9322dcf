"""P2P for one cache server: the owner side, the requester side, and their wiring.

Owns the parts of P2P and their order: the transport's ``TransferServer`` serving this
server's L1 region (its endpoint goes into the registration metadata), the control
channel's ROUTER on the listen URL answering ``hello`` / ``lookup_and_lock`` / ``unlock``
(with the shared token checked when one is set), the controller (peers and adapters)
and the fetcher (the read path; the composition root plugs it into the engine service
as its peer source), plus the ``P2PStats`` snapshot (how /status and the metrics show
each stat is written once in ``p2p.stat_rows``). It reaches the chunk store only through
``PeerStoreAccess``.

Ports: the control channel binds ``--p2p-listen-url`` and is advertised as
``--p2p-advertise-url``; the transport binds what its own config names (tcp: the listen
host at ``--p2p-data-port``, a free port when 0; shm: the region's name; mooncake: its
RPC port; nixl: its agent) and announces it in the endpoint, which peers read from the
registration, never derive from the control port.

Owner-side lease rules: a peer is handed addresses only under read leases held as
``peer:<its id>``, released by its ``unlock`` (its own leases only) or by expiry; the
tcp transport checks each read against those leases (``PeerStoreAccess.peer_may_read``).

Must not: parse flags, choose the transport (the composition root passes a configured
``kvatlas.transfer.factory.Transport``), or know the engine service.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import zmq

from kvatlas.core.errors import ConfigError
from kvatlas.core.keys import HASH_BYTES, object_keys
from kvatlas.core.server.peer_timing import PeerTimingView
from kvatlas.runtime.auth import TokenGate
from kvatlas.runtime.coordinator_client import CoordinatorClient
from kvatlas.runtime.region import L1Region
from kvatlas.server.config import P2PConfig, split_host_port
from kvatlas.server.p2p.channel import ChannelServer
from kvatlas.server.p2p.controller import ENDPOINT_METADATA_KEY, P2PController, P2PState
from kvatlas.server.p2p.fetch import PeerFetcher, PeerFetchStats
from kvatlas.server.p2p.store_access import PeerStoreAccess
from kvatlas.transfer.base import Endpoint, FaultPlan, TransferServer
from kvatlas.transfer.factory import Transport
from kvatlas.wire.p2p_proto import (
    Hello,
    HelloReply,
    Locked,
    LockedChunk,
    LookupAndLock,
    P2PError,
    P2PRequestBody,
    P2PResponseBody,
    Unlock,
    Unlocked,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class P2PStats:
    """A snapshot for /status and /metrics."""

    state: P2PState
    peers: tuple[str, ...]
    active_lookup_jobs: int
    transport: str
    advertise_url: str
    transfer_url: str
    fetch: PeerFetchStats
    cooling_peers: tuple[str, ...]
    """Peers whose breaker is open (skipped until a probe, a new incarnation or a
    reappearance in the listing closes it)."""
    breakers_opened: int
    probes: int
    timings: tuple[PeerTimingView, ...]
    """Per peer: its RPC p99, bandwidth, and the lock and load deadlines they gave."""
    fleet_rpc_p99_s: float | None
    lock_deadline_prior_s: float
    served_locks: int
    served_chunks: int
    served_unlocks: int
    served_reads: int
    """Reads of this node's L1 that peers were allowed (one per transfer op)."""
    refused_requests: int
    adapters_added: int
    adapters_removed: int
    adapters_rebuilt: int
    polls: int
    """Peer listings asked of the coordinator."""
    poll_failures: int
    """Peer listings that failed (the peers were kept)."""
    wire_unknown: tuple[tuple[str, int], ...] = ()
    """Control requests this node could not read, by what (``version``, ``operation``)."""


def check_single_region(region: L1Region, pool_capacity: int) -> None:
    """P2P serves one contiguous shared-memory region: refuse anything else."""
    if not region.name or region.size < pool_capacity:
        raise ConfigError(
            "P2P requires a single contiguous L1 memory region: the L1 pool"
            f" ({pool_capacity} bytes) must lie in one named shared-memory region"
            f" (got {region.name or 'an unnamed region'} of {region.size} bytes);"
            " drop --p2p-advertise-url or use the default L1"
        )


class P2PNode:
    """Build (binds the channel, starts serving the region), ``start()``, ``stop()``."""

    def __init__(
        self,
        *,
        config: P2PConfig,
        instance_id: str,
        incarnation: int,
        chunk_size: int,
        store: PeerStoreAccess,
        region: L1Region,
        transport: Transport,
        coordinator: CoordinatorClient,
        heartbeat_interval_s: float,
        coordinator_timeout_s: float,
        auth_token: str | None,
    ) -> None:
        """``coordinator``: the process's client, shared by the controller's listings
        and the fetcher's directory lookups (bounded by ``coordinator_timeout_s``); the
        composition root closes it. ``auth_token`` guards the control channel and the
        tcp transport."""
        check_single_region(region, store.pool_capacity)
        listen = split_host_port(config.bind_url)
        if listen is None:  # validate() refused this already
            raise ConfigError(f"--p2p-listen-url must be HOST:PORT, got {config.bind_url!r}")
        self.config = config
        self.instance_id = instance_id
        self.incarnation = incarnation
        self._store = store
        self._transport = transport
        self._gate = TokenGate(auth_token)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.served_locks = 0
        self.served_chunks = 0
        self.served_unlocks = 0
        self.served_reads = 0
        self.refused = 0
        try:
            self._channel = ChannelServer(self._ctx, listen[0], listen[1])
            try:
                self._server: TransferServer = transport.server(
                    region, self._authorize, token=auth_token
                )
                self.endpoint: Endpoint = self._server.start()
            except BaseException:
                self._channel.stop()
                raise
        except BaseException:
            self._ctx.term()
            raise
        self.controller = P2PController(
            instance_id=instance_id,
            incarnation=incarnation,
            coordinator=coordinator,
            interval_s=heartbeat_interval_s,
            auth_token=auth_token,
            transport=transport,
            faults=FaultPlan(config.fault_corrupt_read) if config.fault_corrupt_read else None,
            region=region,
            ctx=self._ctx,
            cooloff_s=config.cooloff_s,
            deadlines=config.deadline_policy,
        )
        self.fetcher = PeerFetcher(
            instance_id=instance_id,
            store=store,
            controller=self.controller,
            config=config,
            chunk_size=chunk_size,
            coordinator=coordinator,
            coordinator_timeout_s=coordinator_timeout_s,
            auth_token=auth_token,
        )

    def registration_metadata(self) -> dict[str, str]:
        return {ENDPOINT_METADATA_KEY: json.dumps(self.endpoint.to_builtins(), sort_keys=True)}

    # ------------------------------------------------------------------ owner side

    def _authorize(self, peer_id: str, lease_id: str, offset: int, size: int) -> bool:
        if self.config.fault_read_delay_s > 0:  # tests only: a slow owner
            time.sleep(self.config.fault_read_delay_s)
        allowed = self._store.peer_may_read(peer_id, lease_id, offset, size)
        if allowed:
            self.served_reads += 1
        return allowed

    def handle(self, body: P2PRequestBody) -> P2PResponseBody:
        """Answer one control request (the channel's thread)."""
        if not self._gate.check(body.token):
            self.refused += 1
            log.warning(
                "P2P request from %s refused on instance %s: bad auth token",
                body.requester,
                self.instance_id,
            )
            return P2PError("unauthorized", "bad or missing auth token")
        match body:
            case Hello():
                return HelloReply(self.instance_id, self.incarnation, self.endpoint.to_builtins())
            case LookupAndLock():
                if any(len(h) != HASH_BYTES for h in body.hashes) or not body.lease_s > 0:
                    self.refused += 1
                    return P2PError("invalid_input", "hashes must be 32 bytes, lease_s > 0")
                keys = object_keys(body.hashes, body.ns)
                lease_s = min(body.lease_s, self.config.lock_lease_s)
                leases = self._store.lock_for_peer(body.requester, keys, lease_s)
                self.served_locks += 1
                self.served_chunks += len(leases)
                return Locked(
                    self.instance_id,
                    self.incarnation,
                    [
                        LockedChunk(
                            ls.key.chunk_hash, ls.offset, ls.size, ls.checksum, int(ls.lease_id)
                        )
                        for ls in leases
                    ],
                )
            case Unlock():
                self.served_unlocks += 1
                return Unlocked(self._store.unlock_for_peer(body.requester, body.lease_ids))
        raise AssertionError(f"unhandled P2P request {type(body).__name__}")

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._channel.start(self.handle)
        self.controller.start()
        log.info(
            "P2P on instance %s incarnation %d: control tcp://%s:%d advertised as %s,"
            " transport %s at %s",
            self.instance_id,
            self.incarnation,
            self._channel.host,
            self._channel.port,
            self.config.advertise_url,
            self._transport.name,
            self.endpoint.url,
        )

    def stop(self) -> None:
        self.controller.stop()
        self._channel.stop()
        self._server.stop()
        self._ctx.term()

    def stats(self) -> P2PStats:
        c = self.controller.stats()
        return P2PStats(
            state=c.state,
            peers=c.peers,
            active_lookup_jobs=self.fetcher.active_jobs,
            transport=self._transport.name,
            advertise_url=self.config.advertise_url or "",
            transfer_url=self.endpoint.url,
            fetch=self.fetcher.snapshot(),
            cooling_peers=c.down,
            breakers_opened=c.breakers_opened,
            probes=c.probes,
            timings=c.timings,
            fleet_rpc_p99_s=c.fleet_rpc_p99_s,
            lock_deadline_prior_s=self.config.lock_deadline_prior_s,
            served_locks=self.served_locks,
            served_chunks=self.served_chunks,
            served_unlocks=self.served_unlocks,
            served_reads=self.served_reads,
            refused_requests=self.refused,
            adapters_added=c.adapters_added,
            adapters_removed=c.adapters_removed,
            adapters_rebuilt=c.adapters_rebuilt,
            polls=c.polls,
            poll_failures=c.poll_failures,
            wire_unknown=tuple(sorted(self._channel.unknown.items())),
        )
