"""kvatlas.server.p2p: the cache server's peer-to-peer parts.

``controller`` keeps the peer table from the coordinator's listing, ``channel`` is the
ZeroMQ control channel, ``node`` is one server's P2P (owner and requester sides),
``fetch`` is the read path from a directory hint to committed slots, and
``store_access`` is all P2P may do to the chunk store (peer leases, fetch slots).
"""
