"""GcPauses: every collection of the process is counted and timed, by generation, from
`install()` until `remove()`; a coordinator exports the totals as metrics, and as a
process freezes its startup objects."""

from __future__ import annotations

import gc

import httpx

from kvatlas.launch.procs import free_port
from kvatlas.runtime.gc_pauses import GcPauses
from support.coordinator import RunningCoordinator
from support.launch import launch, python_module


def test_collections_are_counted_and_timed_while_installed() -> None:
    pauses = GcPauses()
    gc.collect()
    assert pauses.collections == [0, 0, 0]  # not installed yet
    pauses.install()
    pauses.install()  # once only
    try:
        for generation in (0, 2, 2):
            gc.collect(generation)
    finally:
        pauses.remove()
    assert pauses.collections[0] >= 1 and pauses.collections[2] >= 2
    assert pauses.total > 0
    assert abs(pauses.total - sum(pauses.seconds)) < 1e-9
    assert 0 < pauses.longest[2] <= pauses.seconds[2]
    seen = list(pauses.collections)
    gc.collect()
    assert pauses.collections == seen  # removed: no longer counted


def test_the_coordinator_exports_its_pauses() -> None:
    coord = RunningCoordinator.start()
    try:
        gc.collect()
        text = coord.client.get("/metrics").text
        runs = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('kvatlas_coordinator_gc_collections_total{generation="2"}')
        ]
        assert runs and runs[0] >= 1
        assert 'kvatlas_coordinator_gc_pause_seconds_total{generation="2"}' in text
        assert 'kvatlas_coordinator_gc_longest_pause_seconds{generation="0"}' in text
    finally:
        coord.stop()


def test_the_coordinator_process_freezes_what_startup_built() -> None:
    """Run as a process (its main thread), the coordinator moves its startup objects out
    of the collector's sight: full collections then skip them."""
    port = free_port()
    argv = python_module(
        "kvatlas.cli.coordinator",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "WARNING",
    )
    with launch(argv, name="coordinator-gc", http_port=port):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    frozen = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvatlas_coordinator_gc_frozen_objects ")
    ]
    assert frozen and frozen[0] > 10_000
