"""The attack suite: each known attack on the services replayed against real
processes (coordinator, cache server, engine API, tcp data port, P2P channel) started
through their CLIs with the shared token from a file, asserting the fix. It runs with
every other test (`make check`); counts are small and deadlines short.

- non-ASCII tokens (x4) on the engine API, `/status`, `/metrics`: `test_engine_api.py`
- acting as another instance, cursor bounds: `test_impersonation.py`
- `seq = 2**64`, snapshots going on, SIGTERM's last snapshot:
  `test_coordinator_inputs.py`
- a bit flip in the snapshot refused at startup: `test_coordinator_inputs.py`
- trickled headers and stalled bodies (408), the buffered-bytes budget and the
  connection cap (503), memory returned, normal clients answered: `test_http_edge.py`;
  engine-API messages over 16 MiB, an engine flooding the engine API without reading
  (answered `overloaded` beyond the queue bounds, memory bounded, other engines' hits
  answered, the connector recomputing): `test_engine_api.py`
- idle unauthenticated data-port connections, huge P2P channel messages:
  `test_data_path.py`
- L2 claims of a never-registered instance, L2 retention of departed ones:
  `test_l2_placements.py`
- 100k-deep JSON, `?offset=2**63`: `test_coordinator_inputs.py`
- the registration metadata cap, the token kept out of `ps`:
  `test_coordinator_inputs.py`

Covered by real-process tests elsewhere, not repeated here: lease ownership
(`tests/server/test_server_process.py::test_an_engine_cannot_end_another_engines_read_leases`).
Freed namespaces and owners are memory, measured on the directory itself
(`tests/core/test_directory.py::test_namespaces_that_hold_no_key_any_more_are_freed`,
`::test_owners_that_hold_nothing_any_more_are_freed`). Each module's docstring names the
tests of the same rules on the components alone.
"""
