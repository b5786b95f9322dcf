"""Encoding only: HTTP, Kafka and engine-API message shapes <-> core types (msgspec)."""
