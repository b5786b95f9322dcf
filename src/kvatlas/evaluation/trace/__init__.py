"""Real traffic: Mooncake's published traces (the vendored FAST'25 conversation trace),
their loader (``mooncake``) and a fast in-process simulation of the cache policies over
them (``simulate``)."""
