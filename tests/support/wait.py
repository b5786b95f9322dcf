"""The one wait of the test suites: poll an observable condition until it holds.

Owns ``wait_until``: call ``observe`` every ``every`` seconds until ``done`` accepts what it
returned, and fail after ``timeout`` with a message that names what was awaited and the
last value seen (or the last exception ``ignore`` let through), so a timeout says how far
the system got. Must not: sleep for a fixed time instead of observing, or swallow an
exception it was not told to ignore (a dead process must fail the wait at once).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_UNSEEN = object()


class WaitTimeout(AssertionError):
    """The awaited condition did not hold in time (an assertion failure of the test)."""


def wait_until(
    observe: Callable[[], T],
    done: Callable[[T], object] = bool,
    *,
    what: str,
    timeout: float = 20.0,
    every: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``observe()`` until ``done(value)`` is true; return that value.

    ``what`` names the condition for the failure message ("node-b lists node-a as a
    peer"). Exceptions of the types in ``ignore`` count as "not yet" (a server that does
    not listen yet); any other exception ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    last: object = _UNSEEN
    while True:
        try:
            value = observe()
        except ignore as exc:
            last = exc
        else:
            if done(value):
                return value
            last = value
        if time.monotonic() >= deadline:
            seen = "nothing (never observed)" if last is _UNSEEN else repr(last)
            if len(seen) > 2000:
                seen = seen[:2000] + "..."
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}; last seen: {seen}")
        time.sleep(every)
