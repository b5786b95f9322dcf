"""kvatlas.transfer: one-sided reads of KV chunks from a peer's L1 region.

    base.py      the interface: Endpoint, ReadOp/ReadResult, TransferServer (owner),
                 TransferClient + PeerConnection (requester), FaultPlan
    errors.py    the transfer part of the exception tree
    config.py    per-transport config, read from the environment in one place
    factory.py   make_transport(name): tcp, shm, mooncake, nixl
    tcp.py       built in: threaded TCP server, pooled pipelined connections
    shm.py       same host: map the owner's region read-only and copy
    mooncake.py  Mooncake Transfer Engine (optional package)
    nixl.py      NIXL with UCX (optional package)

Importing this package imports no transport library.
"""
