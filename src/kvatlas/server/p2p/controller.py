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

It also owns each peer's breaker (``core.peers.PeerHealth``): the fetcher reports
failures and successes, and asks which peers are usable; a peer that shows a new
incarnation or reappears in a listing after being absent gets a closed breaker, and each
poll probes the open ones whose probe is due with a ``hello`` bounded by
``PROBE_TIMEOUT_S`` (half-open: an answer closes the breaker; no answer keeps it open).
When a breaker opens, the peer's ``abandon`` event is set, which ends the control
requests other lookups are still waiting on it with (``ChannelClient.call``): a frozen
peer costs one lock deadline once, for all lookups together.

And each peer's timings (``core.peer_timing.PeerTimings``): the round trips of its
lock and unlock RPCs (not its probes) and the bandwidth of its loads, which give the
fetcher its lock and load deadlines; a new adapter (a new endpoint or incarnation) or
none starts them afresh.

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import msgspec
import zmq

from kvatlas.core.server.peer_timing import DeadlinePolicy, PeerTimings, PeerTimingView
from kvatlas.core.server.peers import ActionKind, PeerEndpoint, PeerHealth, PeerTable
from kvatlas.runtime.coordinator_client import CoordinatorClient, CoordinatorError
from kvatlas.runtime.region import L1Region
from kvatlas.server.p2p.channel import ChannelClient, ChannelError
from kvatlas.transfer.base import Endpoint, FaultPlan, PeerConnection, TransferClient
from kvatlas.transfer.errors import TransferError
from kvatlas.transfer.factory import Transport
from kvatlas.wire.p2p_proto import Hello, HelloReply

log = logging.getLogger(__name__)

ENDPOINT_METADATA_KEY = "p2p_endpoint"
"""Registration metadata key holding the transport's Endpoint as JSON."""
STOP_WAIT_S: Final = 1.0
"""How long ``stop`` waits for a poll in flight (a frozen coordinator would hold it a
whole coordinator timeout)."""
PROBE_TIMEOUT_S: Final = 0.2
"""Bound of one half-open probe (a ``hello`` on the control channel)."""


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
    down: tuple[str, ...]
    """Peers whose breaker is open."""
    breakers_opened: int
    probes: int
    timings: tuple[PeerTimingView, ...]
    """What is known of each peer's answer times, and the deadlines they give."""
    fleet_rpc_p99_s: float | None
    """The p99 of every peer's control round trips: the prior of a peer not yet heard."""


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
        cooloff_s: float = 10.0,
        deadlines: DeadlinePolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
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
        self.listed_at = 0.0
        """Monotonic time of the last successful peer listing (0.0: none yet): the
        coordinator answered then, so the fetcher may ask its directory again."""
        self._polls = 0
        self._poll_failures = 0
        self._added = 0
        self._removed = 0
        self._rebuilt = 0
        self._last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock = clock
        self._health = PeerHealth(cooloff_s=cooloff_s)
        self._health_lock = threading.Lock()  # guards _health, _timings and _abandon
        self._timings = PeerTimings(deadlines)
        self._abandon: dict[str, threading.Event] = {}
        self._probes = 0

    # ------------------------------------------------------------------ breakers

    def usable(self, adapters: list[PeerAdapter]) -> list[PeerAdapter]:
        """Those of ``adapters`` whose breaker is closed (or whose cool-off is over)."""
        now = self._clock()
        with self._health_lock:
            out = [a for a in adapters if self._health.available(a.instance_id, now)]
            for a in out:  # a cool-off that just ran out closed the breaker
                self._abandon_locked(a.instance_id).clear()
            return out

    def _abandon_locked(self, instance_id: str) -> threading.Event:
        ev = self._abandon.get(instance_id)
        if ev is None:
            ev = self._abandon[instance_id] = threading.Event()
        return ev

    def abandon_event(self, instance_id: str) -> threading.Event:
        """Set while the peer's breaker is open: control requests waiting on it end."""
        with self._health_lock:
            return self._abandon_locked(instance_id)

    def peer_failed(self, instance_id: str, *, hard: bool) -> bool:
        """Count a failure of a peer; True when its breaker has just opened (at once
        when ``hard``: it is dead or did not answer within its deadline)."""
        with self._health_lock:
            opened = self._health.record_failure(instance_id, self._clock(), hard=hard)
            if opened:
                self._abandon_locked(instance_id).set()
        if opened:
            log.warning(
                "P2P peer %s is down for instance %s: skipped until it answers a probe,"
                " shows a new incarnation, or %.1fs pass",
                instance_id,
                self.instance_id,
                self._health.cooloff_s,
            )
        return opened

    def peer_ok(self, instance_id: str) -> None:
        with self._health_lock:
            self._health.record_success(instance_id)
            self._abandon_locked(instance_id).clear()

    # ------------------------------------------------------------------ timings

    def lock_deadline(self, instance_id: str, cap_s: float) -> float:
        """Seconds a lock RPC to the peer may wait (at most ``cap_s``)."""
        with self._health_lock:
            return self._timings.lock_deadline(instance_id, cap_s)

    def load_deadline(self, instance_id: str, nbytes: int, cap_s: float) -> float:
        """Seconds a load of ``nbytes`` from the peer may take (at most ``cap_s``)."""
        with self._health_lock:
            return self._timings.load_deadline(instance_id, nbytes, cap_s)

    def rpc_answered(self, instance_id: str, seconds: float) -> None:
        with self._health_lock:
            self._timings.observe_rpc(instance_id, seconds)

    def load_done(self, instance_id: str, nbytes: int, seconds: float) -> None:
        with self._health_lock:
            self._timings.observe_load(instance_id, nbytes, seconds)

    def load_timed_out(self, instance_id: str) -> None:
        with self._health_lock:
            self._timings.load_timed_out(instance_id)

    def down(self) -> list[str]:
        with self._health_lock:
            return self._health.cooling(self._clock())

    def _peer_back(self, instance_id: str, why: str) -> None:
        with self._health_lock:
            was_down = instance_id in self._health.cooling(self._clock())
            self._health.forget(instance_id)
            self._abandon_locked(instance_id).clear()
        if was_down:
            log.info("P2P peer %s is back for instance %s (%s)", instance_id, self.instance_id, why)

    def probe_down_peers(self) -> None:
        """One bounded ``hello`` to each open peer whose probe is due (half-open)."""
        with self._health_lock:
            due = self._health.due_probes(self._clock())
        for iid in due:
            with self._lock:
                adapter = self._adapters.get(iid)
            if adapter is None:
                continue
            self._probes += 1
            try:
                answer = adapter.control.call(
                    Hello(self.instance_id, self._token or ""), PROBE_TIMEOUT_S
                )
            except ChannelError as exc:
                log.debug("probe of P2P peer %s failed: %s", iid, exc)
                with self._health_lock:
                    self._health.record_probe_failure(iid, self._clock())
                continue
            # no RPC sample: a probe goes to a peer in trouble, and one answered as a
            # frozen peer wakes measures how long it was away, which would set its lock
            # deadline to 4x that for the next RPC_SAMPLES round trips
            if isinstance(answer, HelloReply) and (
                not adapter.peer.incarnation or answer.incarnation == adapter.peer.incarnation
            ):
                self._peer_back(iid, "it answered a probe")

    # ------------------------------------------------------------------ queries

    def adapters(self) -> list[PeerAdapter]:
        with self._lock:
            return [self._adapters[i] for i in sorted(self._adapters)]

    def stats(self) -> ControllerStats:
        with self._lock:
            peers = tuple(sorted(self._adapters))
        with self._health_lock:
            timings = tuple(self._timings.views(list(peers)))
            fleet_p99 = self._timings.fleet_rpc_p99()
        return ControllerStats(
            state=self._state,
            peers=peers,
            polls=self._polls,
            poll_failures=self._poll_failures,
            adapters_added=self._added,
            adapters_removed=self._removed,
            adapters_rebuilt=self._rebuilt,
            last_error=self._last_error,
            down=tuple(self.down()),
            breakers_opened=self._health.opened,
            probes=self._probes,
            timings=timings,
            fleet_rpc_p99_s=fleet_p99,
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
        self.listed_at = time.monotonic()
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
            self.probe_down_peers()
            return
        absent = set(self._table.misses())
        for peer in listing:
            if peer.instance_id in absent:
                self._peer_back(peer.instance_id, "it reappeared in the listing")
        for action in self._table.reconcile(listing):
            peer = action.peer
            # a new adapter (a new endpoint or incarnation) or none: its breaker and
            # timings start afresh
            self._peer_back(peer.instance_id, f"{action.kind.value} of its adapter")
            with self._health_lock:
                self._timings.forget(peer.instance_id)
                if action.kind is ActionKind.REMOVE:
                    self._abandon.pop(peer.instance_id, None)
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
        self.probe_down_peers()

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
            stopping = self._stop.is_set()
            if not stopping:
                self._adapters[peer.instance_id] = adapter
        if stopping:  # stop() gave up waiting for this poll and closed the others
            adapter.close()
            return
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
        """Stop polling and close every adapter. A listing still waiting on a frozen
        coordinator after ``STOP_WAIT_S`` is left to its daemon thread, which adds no
        adapter once stopping."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)
            self._thread = None
        with self._lock:
            adapters, self._adapters = list(self._adapters.values()), {}
        for adapter in adapters:
            adapter.close()
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None
