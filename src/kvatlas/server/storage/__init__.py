"""kvatlas.server.storage: the node's tiers.

``l2`` is the L2 adapter interface (with the in-memory adapter), ``l2_disk`` the disk
adapter, ``chunkstore`` L1 and L2 together (stores, prefix lookups with promotion,
demotion on eviction, events per tier), ``guarded`` the store behind its one lock with
its events' way to the publisher (shared by the engine service and the P2P store access).
"""
