"""kvatlas.coordinator.http.edge: the coordinator's HTTP/1.1 server (uvloop and httptools,
no ASGI).

``protocol`` parses (limits, read deadlines on a clock passed in), ``state`` is one
connection as a pure state machine in the manner of h11 (bytes and ``now`` in, events out;
keep-alive, pipelining order, close, linger), ``connection`` its asyncio shell (one
client connection: reads, dispatch, writes),
``server`` the listening socket and what connections share, ``routing`` the routing
table, ``messages`` the request and response types. Must not know any of the
coordinator's routes, state or error tree: the service hands them over.
"""
