"""The pure core: keys, events, the event gate, the key directory, the blend index,
membership and the L1 allocator.

Nothing here opens a socket, starts a thread, reads a clock, the environment or logs:
time is always a parameter. Shells in `coordinator`, `server` and `engine` add I/O.
"""
