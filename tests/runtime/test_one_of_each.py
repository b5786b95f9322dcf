"""One of each mechanism: the breaker is `core.breaker`'s and a background task's loop is
`runtime.periodic`'s. Another construction in src/ fails here, naming the file and line,
unless the allow list below says why it stands (the HTTP client factory has its own test,
``test_http_clients.py``)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kvatlas"

BREAKER_HOME = SRC / "core" / "breaker.py"
BREAKER = re.compile(r"class\s+\w*Breaker\b|\bopen_until\s*=(?!=)|\bhalf_open\s*=(?!=)")
"""A breaker class, or the state a breaker keeps (when it opened until, half-open)."""

PERIODIC_HOME = SRC / "runtime" / "periodic.py"
PERIODIC = re.compile(r"while\s+not\s+[\w.]+\.wait\(")
"""The hand-written periodic loop: ``while not stop.wait(interval)``."""
PERIODIC_ALLOWED = {
    # The main thread of a service started by `run_in_threads`: it waits for a signal,
    # checking now and then that the server it started is alive; no task runs there.
    SRC / "runtime" / "asgi_thread.py": "the main thread's wait for a signal",
}


def _found(pattern: re.Pattern[str], skip: set[Path]) -> list[str]:
    return [
        f"{path.relative_to(SRC)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for path in sorted(SRC.rglob("*.py"))
        if path not in skip
        for text in [path.read_text()]
        for m in pattern.finditer(text)
    ]


def test_every_breaker_is_core_breaker() -> None:
    found = _found(BREAKER, {BREAKER_HOME})
    assert not found, "use kvatlas.core.breaker.Breaker:\n" + "\n".join(found)


def test_every_periodic_loop_is_runtime_periodic() -> None:
    found = _found(PERIODIC, {PERIODIC_HOME, *PERIODIC_ALLOWED})
    assert not found, "use kvatlas.runtime.periodic.Periodic:\n" + "\n".join(found)


def test_the_homes_and_the_allow_list_still_hold_what_they_name() -> None:
    """The patterns find the real thing (so the tests above can fail), and an allowed
    file that no longer loops by hand leaves the list."""
    assert BREAKER.search(BREAKER_HOME.read_text())
    assert PERIODIC.search(PERIODIC_HOME.read_text())
    for path in PERIODIC_ALLOWED:
        assert PERIODIC.search(path.read_text()), path
