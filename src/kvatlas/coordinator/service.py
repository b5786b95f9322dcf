"""The coordinator service: builds the parts that own the fleet state's operations.

The state is one `state.fleet.LockedFleet` (the `FleetState`, its lock and the consumer
positions); each part owns one family of operations on it and is named here:
``readiness`` (`/readyz`), ``membership`` (register, heartbeat, deregister, the chunk
size), ``expiry`` (silent and departed instances), ``ingest`` (event batches),
``lookups``, ``views`` (members, usage, stats, key pages, the metrics sample) and
``snapshots``. Every transport (HTTP handlers, the Kafka consumer, the expiry loop)
calls the part that owns the operation; the lock discipline is `state.fleet`'s.

Must not: do network or file I/O, read a clock (times are parameters: the HTTP shell
passes its clock, the Kafka shell the record's timestamp; where a part needs one itself,
it is injected, and only the composition root gives the real one), or know about HTTP.
"""

from __future__ import annotations

from collections.abc import Callable

from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.state.expiry import Expiry
from kvatlas.coordinator.state.fleet import LockedFleet
from kvatlas.coordinator.state.ingest import Ingest
from kvatlas.coordinator.state.lookups import Lookups
from kvatlas.coordinator.state.membership import Members
from kvatlas.coordinator.state.readiness import Readiness
from kvatlas.coordinator.state.snapshots import Snapshots
from kvatlas.coordinator.state.views import Views
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.credentials import Bounds
from kvatlas.core.keys import ChainMemo


class CoordinatorService:
    """One `FleetState` behind one lock, and the parts that change and read it."""

    def __init__(
        self,
        fleet: FleetState,
        metrics: CoordinatorMetrics,
        *,
        clock: Callable[[], float],
        timer: Callable[[], float],
        bounds: Bounds | None = None,
        memo: ChainMemo | None = None,
    ) -> None:
        """``clock``: wall seconds (the metrics sample's heartbeat ages). ``timer``:
        monotonic seconds, for how long the snapshot held the lock (a wall clock a test
        sets by hand would make that duration meaningless). ``bounds``: the credential
        requirement and cursor bounds every request about an instance is held to
        (`core.credentials`). ``memo``: recent links of the token hash chain, for
        lookups by tokens (`--token-hash-memo-bytes`)."""
        self.state = LockedFleet(fleet, metrics, bounds)
        self.readiness = Readiness()
        self.membership = Members(self.state, None if memo is None else memo.chunk_size)
        self.expiry = Expiry(self.state)
        self.ingest = Ingest(self.state)
        self.lookups = Lookups(self.state, memo)
        self.views = Views(self.state, clock)
        self.snapshots = Snapshots(self.state, timer)
