"""LMCache's multiprocess (MP) protocol, 0.5.6 and 0.5.7rc2 (``wire.LMCACHE_VERSIONS``),
served by ``kvatlas server`` on ``--port``.

vLLM's ``LMCacheMPConnector`` runs LMCache's own client library (its scheduler and
worker adapters); pointed at ``kvatlas server`` instead of ``lmcache server``, with the
same ``--port``, ``--chunk-size``, ``--l1-size-gb`` and ``--eviction-policy``, it stores
into and retrieves from kvatlas' L1/L2, whose chunks the coordinator's directory lists
and P2P peers serve. Users keep ``lmcache`` installed beside vLLM and replace only the
server process.

Modules: ``wire`` (framing, payloads, replies, the supported versions), ``service``
(composes the parts below and dispatches to them), ``workers`` (registered workers,
their contracts and hybrid KV groups), ``store_side`` (every change to the shared
``GuardedStore``, under its lock), ``lookups`` (lookups, P2P prefetch), ``sessions``
(each request's lookup result and read leases), ``transfers`` (both transfer modes and
(un)registration), ``management`` (chunk size, heartbeats, plug-in calls, clear),
``core`` (identity, ``MpError``, chunk keys), ``hashing`` (the checksums of committed
chunks, computed while the workers are quiet), ``cpu_kv`` (a worker's CPU KV mapped
from POSIX SHM), ``cuda_kv`` (a worker's GPU KV from CUDA IPC handles), ``transport``
(the engine API's ROUTER hands LMCache-framed requests here) and ``metrics``.

Transfer modes:

- engine-driven (``PREPARE_STORE``/``COMMIT_STORE``/``PREPARE_RETRIEVE``/
  ``COMMIT_RETRIEVE``): the worker copies its KV itself, GPU to host, into slots of the
  server's L1 shared-memory region, whose name it is given at registration. The server
  needs no CUDA and no torch, so this mode serves GPU workers too: select it in vLLM
  with ``"lmcache.mp.mp_transfer_mode": "engine_driven"`` in
  ``kv_connector_extra_config`` (or ``LMCACHE_MP_TRANSFER_MODE=engine_driven``). The
  worker must share the host (and its /dev/shm) with the server.
- lmcache-driven with CPU KV (``REGISTER_KV_CACHE`` of POSIX SHM tensors,
  ``STORE``/``RETRIEVE`` with block ids): the server maps the worker's paged KV and
  copies chunks itself.
- lmcache-driven with CUDA IPC handles of kind ``cuda`` (PyTorch shared storage,
  LMCache's default wrapper): ``cuda_kv`` opens them with torch, which the server
  imports only when such a registration arrives. ``cuda_raw``/``cuda_vmm`` handles are
  refused with a message naming engine-driven mode.

Must not: reach into the kvatlas engine API (``engine_service``), or keep chunk state
outside the shared store.
"""
