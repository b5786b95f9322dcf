"""kvatlas.coordinator.edge: the coordinator's HTTP/1.1 server (uvloop and httptools,
no ASGI).

``protocol`` is the sans-I/O core (parsing, limits, deadlines on a clock passed in),
``connection`` its asyncio shell (one client connection: reads, dispatch, answers),
``server`` the listening socket and what connections share, ``routing`` the routing
table, ``messages`` the request and response types. Must not know any of the
coordinator's routes, state or error tree: the service hands them over.
"""
