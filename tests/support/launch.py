"""The test suites' face of the one launcher (``kvatlas.launch.procs``).

Owns remembering every process a test session launched, so that a failed test's report
carries the tails of the logs of the processes it started (see ``tests/conftest.py``).
Starting, readiness waits, logs and stopping by pid are the launcher's.

Must not: start a process but through the launcher's ``Proc.launch``, or signal
anything but the processes it started, by pid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

from kvatlas.launch.procs import P, Proc, python_module

__all__ = ["LAUNCHED", "P", "Proc", "launch", "python_module"]

LAUNCHED: list[Proc] = []
"""Every process launched in this test session, oldest first (for failure reports)."""


@overload
def launch(argv: Sequence[str], *, name: str, cls: type[P], **kwargs: Any) -> P: ...


@overload
def launch(argv: Sequence[str], *, name: str, **kwargs: Any) -> Proc: ...


def launch(
    argv: Sequence[str],
    *,
    name: str,
    cls: type[Proc] = Proc,
    **kwargs: Any,
) -> Proc:
    """``cls.launch`` (``Proc.launch``: start, then wait until ready), remembering the
    process (before its wait, so that a start that fails still shows its log)."""
    return cls.launch(argv, name=name, on_start=LAUNCHED.append, **kwargs)
