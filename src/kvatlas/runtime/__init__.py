"""kvatlas.runtime: small shared pieces that every process may use.

The shared-memory region (``region``), binding (``net``, and ``zmq_sockets`` for
ZeroMQ), optional packages (``extras``), the uvicorn thread
(``asgi_thread``), the shared-token gate (``auth``), the garbage collector's pauses
(``gc_pauses``), the one client of the coordinator's API (``coordinator_client``),
process helpers (``procs``): the pieces that the coordinator, the cache server, the
transports, the engines and the evaluation all need without depending on each other.
What only the coordinator uses (its HTTP server, allocator and CPU latency tuning) lives
in ``kvatlas.coordinator``.
Must not: import any of the process packages (coordinator, server, transfer, connector,
engine, evaluation, cli).
"""
