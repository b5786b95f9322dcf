"""kvatlas.engine: what inference engines use to talk to their local cache server.

``kvatlas.engine.client.CacheClient`` is the engine side of the engine API: register a
model's hash contract, look up how many leading tokens are cached, store and read chunks
through the server's shared L1 region (``store_chunks`` / ``retrieve_prefix``).
"""
