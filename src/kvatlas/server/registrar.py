"""The registrar: this server's membership at the coordinator.

Owns registration (``POST /instances``, binding the instance to the digest of this
process's secret, which it then hands to the `CoordinatorClient` so that every later
request about this instance presents it), the heartbeat loop (``PUT
/instances/{id}/heartbeat`` every interval), re-registration when a heartbeat answers 404,
deregistration at shutdown, and the hash contracts declared to the coordinator. After a
re-registration that followed a 404 — the coordinator lost this instance (a restart
without snapshot, or an expiry) — it calls ``on_resync`` so that the owner republishes a
STORE for everything it holds and the directory is rebuilt.

A coordinator that cannot be reached only changes the state to ``disconnected``: the
server keeps serving its engines and the loop keeps trying every interval.

Replicas: the `CoordinatorClient` fails over between them by itself, and the owner tells
the registrar (``replica_changed``). Replicas that share a Kafka log know this instance
whichever of them it registered with, so nothing more is needed: the next heartbeat
lands on the new replica (a 404 there, before the log reached it, re-registers as
usual). Replicas that share nothing (``resync_on_failover``: events over HTTP) do not:
the registrar registers again on the new replica, with the same incarnation (no fence
anywhere), and resyncs so that its directory learns everything this server holds.

Must not: touch the chunk store or the event stream itself (``on_resync`` does that),
build coordinator URLs or close the `CoordinatorClient` (its owner, the composition
root, does).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from kvatlas.core.credentials import credential_digest
from kvatlas.core.keys import HashContract
from kvatlas.core.types import Incarnation, InstanceId
from kvatlas.runtime.coordinator_client import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorRefused,
    CoordinatorUnreachable,
    UnknownInstance,
)
from kvatlas.server.errors import ServerError
from kvatlas.wire.fleet_view import ENGINE_URLS_KEY
from kvatlas.wire.instances_api import ContractWire, RegisterRequest

log = logging.getLogger(__name__)

SHUTDOWN_S: Final = 1.0
"""At shutdown, the longest wait for a coordinator call in flight, and for the
deregistration: a frozen coordinator held a stopping server one coordinator timeout
(5 s by default) per call, and a silent instance is expired anyway."""


class RegistrationState(enum.StrEnum):
    """Where this server stands with the coordinator."""

    UNREGISTERED = "unregistered"
    """Not (or no longer) registered: never reached, refused, or deregistered."""
    REGISTERED = "registered"
    """The last registration or heartbeat succeeded."""
    DISCONNECTED = "disconnected"
    """Registered before, but the coordinator cannot be reached right now."""


@dataclass(frozen=True, slots=True)
class RegistrarStats:
    state: RegistrationState
    registrations: int
    heartbeats: int
    heartbeat_failures: int
    reregistrations_after_404: int
    resyncs: int
    contracts: tuple[str, ...]
    last_error: str
    url: str
    """The coordinator replica in use."""
    failovers: int
    """Times the client moved to another coordinator replica."""


@dataclass(frozen=True, slots=True)
class Identity:
    """What this server declares at registration."""

    instance_id: InstanceId
    incarnation: Incarnation
    ip: str
    http_port: int
    mq_port: int
    p2p_advertised_url: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    """Extra registration metadata (P2P: the transfer endpoint as ``p2p_endpoint``)."""
    engine_urls: tuple[str, ...] = ()
    """OpenAI URLs of this node's engines (``--engine-url``), advertised as
    ``engine_urls`` with those the engines add (``advertise_engine``)."""


class Registrar:
    """Register, heartbeat, re-register on 404 (then resync), deregister on stop."""

    def __init__(
        self,
        coordinator: CoordinatorClient,
        identity: Identity,
        *,
        heartbeat_interval_s: float = 5.0,
        on_resync: Callable[[], None] | None = None,
        resync_on_failover: bool = False,
        secret: str = "",
        on_secret: Callable[[str], None] | None = None,
    ) -> None:
        """``secret``: this process's instance secret ("": register unbound). Until a
        registration succeeds the client presents whatever it holds (the previous
        process's secret, which proves this one's registration after a crash); then this
        one, and ``on_secret`` keeps it for the next start (a ServerError is logged)."""
        self._coordinator = coordinator
        self._resync_on_failover = resync_on_failover
        self._failed_over_to = ""
        """Set (from any thread, without the lock) when the client changed replica."""
        self._secret = secret
        self._on_secret = on_secret
        self.identity = identity
        self._interval = heartbeat_interval_s
        self._on_resync = on_resync
        self._lock = threading.Lock()  # one request at a time; guards the fields below
        self._state = RegistrationState.UNREGISTERED
        self._contracts: dict[str, HashContract] = {}
        self._engine_urls: set[str] = set(identity.engine_urls)
        self._last_contract: HashContract | None = None
        self._registrations = 0
        self._heartbeats = 0
        self._hb_failures = 0
        self._rereg = 0
        self._resyncs = 0
        self._last_error = ""
        self._needs_resync = False
        self._needs_register = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> RegistrationState:
        return self._state

    # ------------------------------------------------------------------ requests

    def _register_locked(self) -> None:
        ident = self.identity
        metadata = dict(ident.metadata)
        if self._contracts:
            metadata["models"] = ",".join(sorted(self._contracts))
        if self._engine_urls:
            metadata[ENGINE_URLS_KEY] = ",".join(sorted(self._engine_urls))
        req = RegisterRequest(
            ip=ident.ip,
            http_port=ident.http_port,
            instance_id=ident.instance_id,
            metadata=metadata,
            p2p_advertised_url=ident.p2p_advertised_url,
            mq_port=ident.mq_port,
            incarnation=ident.incarnation,
            contract=(ContractWire.from_core(self._last_contract) if self._last_contract else None),
            credential_digest=credential_digest(self._secret).hex() if self._secret else "",
        )
        body = self._coordinator.register(req)
        if self._secret and self._coordinator.instance_secret != self._secret:
            self._coordinator.set_instance_secret(self._secret)
            if self._on_secret is not None:
                try:
                    self._on_secret(self._secret)
                except ServerError as exc:
                    log.warning(
                        "instance %s incarnation %d: %s (a restart re-registers only once"
                        " this process has expired)",
                        ident.instance_id,
                        ident.incarnation,
                        exc,
                    )
        self._registrations += 1
        self._state = RegistrationState.REGISTERED
        self._last_error = ""
        log.info("Registered with coordinator as %s", ident.instance_id)
        log.info(
            "registered instance %s incarnation %d at %s (re_registered=%s)",
            ident.instance_id,
            ident.incarnation,
            self._coordinator.url,
            body.re_registered,
        )

    def _heartbeat_locked(self) -> bool:
        """True: alive; False: the coordinator answered 404 (must re-register)."""
        try:
            self._coordinator.heartbeat(self.identity.instance_id)
        except UnknownInstance:
            return False
        self._heartbeats += 1
        self._state = RegistrationState.REGISTERED
        return True

    def tick(self) -> None:
        """One step of the loop: register if needed, else heartbeat (re-register on 404)."""
        resync = False
        with self._lock:
            ident = self.identity
            try:
                failed_over_to, self._failed_over_to = self._failed_over_to, ""
                if self._state is RegistrationState.UNREGISTERED or self._needs_register:
                    self._needs_register = False
                    self._register_locked()
                elif failed_over_to and self._resync_on_failover:
                    log.warning(
                        "instance %s incarnation %d failed over to coordinator replica %s,"
                        " which shares no log with the last one: registering there and"
                        " resyncing",
                        ident.instance_id,
                        ident.incarnation,
                        failed_over_to,
                    )
                    self._failed_over_to = failed_over_to  # kept until the register succeeds
                    self._register_locked()
                    self._failed_over_to = ""
                    self._needs_resync = True
                elif not self._heartbeat_locked():
                    self._rereg += 1
                    log.warning(
                        "coordinator does not know instance %s incarnation %d (404):"
                        " re-registering and resyncing",
                        ident.instance_id,
                        ident.incarnation,
                    )
                    self._state = RegistrationState.UNREGISTERED
                    self._needs_resync = True
                    self._register_locked()
                    self._failed_over_to = ""  # registered and resyncing there already
                if self._needs_resync and self._state is RegistrationState.REGISTERED:
                    self._needs_resync = False
                    self._resyncs += 1
                    resync = True
            except CoordinatorError as exc:
                self._hb_failures += 1
                if isinstance(exc, CoordinatorUnreachable) or exc.status >= 500:
                    # no answer, or a coordinator that cannot serve now (a 503 while
                    # it catches up): still registered as far as this server knows
                    if self._registrations:
                        self._state = RegistrationState.DISCONNECTED
                else:  # refused, or an answer this server cannot read
                    self._state = RegistrationState.UNREGISTERED
                if str(exc) != self._last_error:
                    log.warning(
                        "coordinator unavailable for instance %s incarnation %d: %s",
                        ident.instance_id,
                        ident.incarnation,
                        exc,
                    )
                self._last_error = str(exc)
        if resync and self._on_resync is not None:
            self._on_resync()

    def replica_changed(self, url: str) -> None:
        """The client now talks to replica ``url``; safe from any thread, even one
        inside a request of this registrar (it only takes note and wakes the loop)."""
        self._failed_over_to = url
        self._wake.set()

    def declare_contract(self, contract: HashContract) -> str | None:
        """Remember a model's contract and register it now.

        Returns the coordinator's refusal (a 409 naming the differing field) or None —
        also when the coordinator cannot be reached (the loop declares it later).
        """
        with self._lock:
            known = self._contracts.get(contract.model_name)
            if known == contract and self._state is RegistrationState.REGISTERED:
                return None
            self._contracts[contract.model_name] = contract
            self._last_contract = contract
            try:
                self._register_locked()
            except CoordinatorError as exc:
                if isinstance(exc, CoordinatorRefused) and exc.status == 409:
                    del self._contracts[contract.model_name]
                    self._last_contract = known
                    self._needs_register = True  # restore the previous declaration
                    return (
                        f"coordinator refused the registration of {self.identity.instance_id}"
                        f" (409): {exc.reason}"
                    )
                self._needs_register = True
                self._last_error = str(exc)
            return None

    def advertise_engine(self, url: str) -> None:
        """Add an engine's OpenAI URL to the registration; the loop re-registers soon
        (not here: an engine's registration must not wait on the coordinator)."""
        with self._lock:
            if url in self._engine_urls:
                return
            self._engine_urls.add(url)
            self._needs_register = True
        log.info("instance %s advertises engine %s", self.identity.instance_id, url)
        self._wake.set()

    def deregister(self, timeout_s: float | None = None) -> None:
        """``DELETE /instances/{id}`` (within ``timeout_s``, the client's timeout by
        default); failures are logged, not raised."""
        with self._lock:
            iid = self.identity.instance_id
            try:
                self._coordinator.deregister(iid, timeout_s=timeout_s)
                log.info("deregistered instance %s", iid)
            except CoordinatorError as exc:
                log.warning("deregistration of instance %s failed: %s", iid, exc)
            self._state = RegistrationState.UNREGISTERED

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvatlas-registrar", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("registrar tick of %s failed", self.identity.instance_id)
            delay = self._interval
            if self._state is not RegistrationState.REGISTERED:
                delay = min(self._interval, 1.0)  # come back quickly after an outage
            self._wake.wait(delay)
            self._wake.clear()

    def stop(self, deregister: bool = True) -> None:
        """Stop the loop and deregister, within about ``2 * SHUTDOWN_S``: a heartbeat
        still in flight after ``SHUTDOWN_S`` (a frozen coordinator) is left to its daemon
        thread and the deregistration skipped; the coordinator expires the instance."""
        self._stop.set()
        self._wake.set()
        busy = False
        if self._thread is not None:
            self._thread.join(SHUTDOWN_S)
            busy = self._thread.is_alive()
            self._thread = None
        if busy:
            log.warning(
                "instance %s incarnation %d: a coordinator call is still in flight at"
                " shutdown; not deregistering (the coordinator expires the instance)",
                self.identity.instance_id,
                self.identity.incarnation,
            )
        elif deregister and self._registrations:
            self.deregister(timeout_s=SHUTDOWN_S)

    def stats(self) -> RegistrarStats:
        # No lock: a request in flight may hold it for a whole timeout, and /status must
        # answer at once; each field is read atomically.
        client = self._coordinator.stats()
        return RegistrarStats(
            state=self._state,
            registrations=self._registrations,
            heartbeats=self._heartbeats,
            heartbeat_failures=self._hb_failures,
            reregistrations_after_404=self._rereg,
            resyncs=self._resyncs,
            contracts=tuple(sorted(self._contracts)),
            last_error=self._last_error,
            url=client.url,
            failovers=client.failovers,
        )
