"""kvatlas.coordinator.host: the coordinator's tuning of the process and machine it runs
on: glibc's allocator (``allocator``) and the CPUs' wake-up latency (``cpu_latency``).
Each is called by the composition root (`coordinator.app`) or the HTTP server, never
by a service object.
"""
