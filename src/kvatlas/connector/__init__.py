"""kvatlas.connector: what any inference engine needs to use its local cache server.

``client.CacheClient`` is the engine side of the engine API (register a model's hash
contract, look up how many leading tokens are cached, store and read chunks through the
server's shared L1 region); ``kv_connector.KVConnector`` builds on it: fetch a verified
cached prefix, store new chunks, fall back to recompute. No torch: an engine integration
imports this package alone, and the reference engine (``kvatlas.engine``) is one user.
"""
