"""Optional packages, and the one refusal that names the extra installing them.

Owns ``needs_extra``: the block inside which a process imports an optional package (torch
for ``kvatlas engine``, confluent-kafka for ``--event-transport kafka``), where a
third-party module that is not installed becomes ``MissingExtra``, a ``ConfigError``
whose one line names the package and the ``pip install 'kvatlas[EXTRA]'`` that brings
it: refused at startup with status 2, never a traceback; and ``require_modules``, the
same refusal for packages a command's own processes will load (``kvatlas bench``).

    ConfigError (kvatlas.core.errors)
     +-- MissingExtra   an optional package a flag or a command needs is not installed

Must not: import an optional package itself, or decide which are optional (a caller
wraps the imports it knows are); a missing kvatlas module is a broken install, and
passes through as it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Sequence

from kvatlas.core.errors import ConfigError


class MissingExtra(ConfigError):
    """An optional package is not installed; the message names the extra to install."""

    def __init__(self, what: str, module: str, extra: str, also: str = "") -> None:
        """``module``: one package or several (comma-separated); ``also``: an install
        step beyond the extra (a browser Playwright downloads)."""
        more = f" and {also}" if also else ""
        super().__init__(
            f"{what} needs {module}, which is not installed: pip install 'kvatlas[{extra}]'{more}"
        )
        self.module = module
        self.extra = extra


@contextlib.contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Turn a third-party module missing inside the block into MissingExtra: ``what``
    (a command or a flag) needs it, ``extra`` installs it."""
    try:
        yield
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        if not top or top == "kvatlas":
            raise
        raise MissingExtra(what, top, extra) from exc


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it: not importable either
        return False


def require_modules(extra: str, what: str, modules: Sequence[str], also: str = "") -> None:
    """MissingExtra unless every module of ``modules`` can be imported (found, not
    loaded: the caller's own processes load them); ``also`` adds an install step."""
    missing = [m for m in modules if not _found(m)]
    if missing:
        raise MissingExtra(what, ", ".join(missing), extra, also)
