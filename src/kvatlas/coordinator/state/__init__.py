"""The coordinator's state service, cut by job over one locked `FleetState`.

`fleet.LockedFleet` is the one shared state (the fleet, its lock, the consumer
positions); `readiness`, `membership`, `expiry`, `ingest`, `lookups`, `views` and
`snapshots` each own one family of operations on it, and `coordinator.service` builds
them and names them. Must not: know about HTTP, Kafka or files, or read a clock other
than the one injected.
"""
