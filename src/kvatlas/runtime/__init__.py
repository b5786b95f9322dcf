"""kvatlas.runtime: small shared pieces that every process may use.

The shared-memory region (``region``), binding (``net``), the HTTP/1.1 server
(``http_server``), the shared-token gate (``auth``), the one client of the coordinator's
API (``coordinator_client``), process helpers (``procs``): the pieces that the
coordinator, the cache server, the transports, the engines and the evaluation all need
without depending on each other.
Must not: import any of the process packages (coordinator, server, transfer, connector,
engine, evaluation, cli).
"""
