"""The router's load accounting per engine (``router/engines.py``)."""

from __future__ import annotations

from kvatlas.router.engines import EngineState


def test_a_probe_taken_during_the_routers_own_request_does_not_outlive_it() -> None:
    e = EngineState("http://127.0.0.1:1", "node-a")
    e.begin(512, now=0.0)
    e.probed(True, running=1, reason="", now=0.1)  # the engine counts the router's request
    assert e.load == 1
    e.end(512, now=0.2)
    # Before: max(in_flight, reported) kept it at 1 until the next probe, so sequential
    # requests all avoided this engine.
    assert e.load == 0


def test_other_clients_requests_count_on_top_of_the_routers_own() -> None:
    e = EngineState("http://127.0.0.1:1", "node-a")
    e.begin(512, now=0.0)
    e.probed(True, running=3, reason="", now=0.1)  # two that the router did not send
    assert e.load == 3
    e.begin(512, now=0.2)
    assert e.load == 4
    e.end(512, now=0.3)
    e.end(512, now=0.4)
    assert e.load == 2
    e.probed(True, running=0, reason="", now=0.5)
    assert e.load == 0
