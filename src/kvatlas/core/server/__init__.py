"""The pure core the cache server owns: the L1 pool and its shares, the warm restart's
journal replay, eviction and peer choice. No I/O, no clocks."""
