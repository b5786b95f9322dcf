"""The P2P controller: who the peers are, and one adapter per live peer.

Owns the poll loop (``GET /instances`` every heartbeat interval, in one thread that waits
on an event between polls), the ``PeerTable`` it reconciles each successful listing
into (add / rebuild on a changed endpoint or incarnation / remove after 3 successful
listings without the peer; never this server itself), and the adapters: a control
channel client plus a ``PeerConnection`` per peer, built from the listing alone (the
peer's transport ``Endpoint`` travels in its registration metadata, ``p2p_endpoint``).
All connections come from one ``TransferClient`` (the local region registered once),
made when the first peer appears; ``faults`` go to it, so ``--p2p-fault-corrupt-read``
corrupts the Nth chunk this server reads, whatever the transport. A coordinator
that cannot be reached is not a listing: nothing is removed, and peers keep serving each
other through the outage.

``p2p_state`` follows the listings: registered (this server is in the last successful
listing), unregistered (it is not, or never got one), disconnected (the last poll failed
after an earlier success).

Must not: move KV bytes or touch the chunk store (``fetch`` does), or close the
`CoordinatorClient` it lists through (the composition root owns it).
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass

import msgspec
import zmq

from kvatlas.core.peers import ActionKind, PeerEndpoint, PeerTable
from kvatlas.runtime.coordinator_client import CoordinatorClient, CoordinatorError
from kvatlas.runtime.region import L1Region
from kvatlas.server.p2p.channel import ChannelClient
from kvatlas.transfer.base import Endpoint, FaultPlan, PeerConnection, TransferClient
from kvatlas.transfer.errors import TransferError
from kvatlas.transfer.factory import Transport

log = logging.getLogger(__name__)

ENDPOINT_METADATA_KEY = "p2p_endpoint"
"""Registration metadata key holding the transport's Endpoint as JSON."""


class P2PState(enum.StrEnum):
    REGISTERED = "registered"
    DISCONNECTED = "disconnected"
    UNREGISTERED = "unregistered"


@dataclass
class PeerAdapter:
    """How to reach one peer: its control channel and a transport connection into its L1."""

    index: int
    peer: PeerEndpoint
    endpoint: Endpoint
    control: ChannelClient
    link: PeerConnection

    @property
    def instance_id(self) -> str:
        return self.peer.instance_id

    def close(self) -> None:
        self.control.close()
        self.link.close()


@dataclass(frozen=True, slots=True)
class ControllerStats:
    state: P2PState
    peers: tuple[str, ...]
    polls: int
    poll_failures: int
    adapters_added: int
    adapters_removed: int
    adapters_rebuilt: int
    last_error: str


class P2PController:
    """Discovery and adapters; ``start()`` runs the poll thread, ``stop()`` closes all."""

    def __init__(
        self,
        *,
        instance_id: str,
        incarnation: int,
        coordinator: CoordinatorClient,
        interval_s: float,
        auth_token: str | None,
        transport: Transport,
        faults: FaultPlan | None,
        region: L1Region,
        ctx: zmq.Context[zmq.Socket[bytes]],
    ) -> None:
        self.instance_id = instance_id
        self.incarnation = incarnation
        self._coordinator = coordinator
        self._interval = interval_s
        self._token = auth_token
        self._transport = transport
        self._faults = faults
        self._transfer: TransferClient | None = None  # made for the first peer
        self._region = region
        self._ctx = ctx
        self._table = PeerTable(instance_id)
        self._adapters: dict[str, PeerAdapter] = {}
        self._lock = threading.Lock()  # guards _adapters (read by fetches)
        self._next_index = 0
        self._state = P2PState.UNREGISTERED
        self._ever_listed = False
        self._polls = 0
        self._poll_failures = 0
        self._added = 0
        self._removed = 0
        self._rebuilt = 0
        self._last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ queries

    def adapters(self) -> list[PeerAdapter]:
        with self._lock:
            return [self._adapters[i] for i in sorted(self._adapters)]

    def stats(self) -> ControllerStats:
        with self._lock:
            peers = tuple(sorted(self._adapters))
        return ControllerStats(
            state=self._state,
            peers=peers,
            polls=self._polls,
            poll_failures=self._poll_failures,
            adapters_added=self._added,
            adapters_removed=self._removed,
            adapters_rebuilt=self._rebuilt,
            last_error=self._last_error,
        )

    # ------------------------------------------------------------------ polling

    def _listing(self) -> list[PeerEndpoint] | None:
        try:
            instances = self._coordinator.instances()
        except CoordinatorError as exc:
            self._poll_failures += 1
            if self._ever_listed:
                self._state = P2PState.DISCONNECTED
            if str(exc) != self._last_error:
                log.warning(
                    "P2P peer listing failed on instance %s incarnation %d: %s (peers kept)",
                    self.instance_id,
                    self.incarnation,
                    exc,
                )
            self._last_error = str(exc)
            return None
        self._ever_listed = True
        self._last_error = ""
        me = [i for i in instances if i.instance_id == self.instance_id]
        self._state = P2PState.REGISTERED if me else P2PState.UNREGISTERED
        return [
            PeerEndpoint(
                instance_id=i.instance_id,
                url=i.p2p_advertised_url or "",
                incarnation=i.incarnation,
                # only the endpoint: other metadata (models) changing is no reason to rebuild
                metadata={ENDPOINT_METADATA_KEY: i.metadata[ENDPOINT_METADATA_KEY]},
            )
            for i in instances
            if i.p2p_advertised_url and ENDPOINT_METADATA_KEY in i.metadata
        ]

    def poll_once(self) -> None:
        """One listing and the adapter changes it implies."""
        self._polls += 1
        listing = self._listing()
        if listing is None:
            return
        for action in self._table.reconcile(listing):
            peer = action.peer
            if action.kind is ActionKind.REMOVE:
                self._drop(peer.instance_id)
                self._removed += 1
                log.info(
                    "Removed P2P adapter for peer %s (instance %s incarnation %d)",
                    peer.instance_id,
                    self.instance_id,
                    self.incarnation,
                )
                continue
            if action.kind is ActionKind.REBUILD:
                self._drop(peer.instance_id)
                self._rebuilt += 1
                log.info(
                    "Rebuilding P2P adapter for peer %s (%s, incarnation %d)",
                    peer.instance_id,
                    peer.url,
                    peer.incarnation,
                )
            self._add(peer)

    def _transfer_client(self) -> TransferClient:
        """The one transfer client of this server (the poll thread alone calls this)."""
        if self._transfer is None:
            self._transfer = self._transport.client(
                self._region, self.instance_id, token=self._token, faults=self._faults
            )
        return self._transfer

    def _add(self, peer: PeerEndpoint) -> None:
        try:
            endpoint = msgspec.json.decode(peer.metadata[ENDPOINT_METADATA_KEY], type=Endpoint)
            link = self._transfer_client().connect(endpoint)
        except (msgspec.DecodeError, KeyError, TransferError) as exc:
            log.warning(
                "cannot build a P2P adapter for peer %s (%s) on instance %s: %s",
                peer.instance_id,
                peer.url,
                self.instance_id,
                exc,
            )
            return
        adapter = PeerAdapter(
            self._next_index, peer, endpoint, ChannelClient(self._ctx, f"tcp://{peer.url}"), link
        )
        self._next_index += 1
        with self._lock:
            self._adapters[peer.instance_id] = adapter
        self._added += 1
        log.debug(
            "Added P2P adapter %d for peer %s (%s)", adapter.index, peer.instance_id, peer.url
        )

    def _drop(self, instance_id: str) -> None:
        with self._lock:
            adapter = self._adapters.pop(instance_id, None)
        if adapter is not None:
            adapter.close()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="p2p-controller-thread", daemon=True)
        self._thread.start()
        log.info(
            "Started p2p-controller-thread (interval=%.1fs) on instance %s incarnation %d",
            self._interval,
            self.instance_id,
            self.incarnation,
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:
                log.exception("P2P poll of instance %s failed", self.instance_id)
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        with self._lock:
            adapters, self._adapters = list(self._adapters.values()), {}
        for adapter in adapters:
            adapter.close()
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None
