"""kvatlas.runtime: small shared pieces that every process may use.

The shared-memory region (``region``), and the other pieces that the coordinator, the
cache server, the transports and the engines all need without depending on each other.
Must not: import any of the process packages (coordinator, server, transfer, connector,
engine, evaluation, cli).
"""
