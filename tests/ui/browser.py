"""Headless Chromium for the page tests: Debian's `chromium` driven by Playwright's Python
package through ``executable_path`` (`playwright install` downloads a browser, which
cannot work here). Launched with the flags a closed network needs and a fresh profile
directory. Without the browser or the driver the tests are skipped, except under CI
(``CI`` set), where scripts/bootstrap.sh installs both and their absence is a failure."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Page
else:
    Page = Any

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def _console(kind: str, text: str, errors: list[str]) -> None:
    # A 401 is how the page learns it needs the token; Chromium logs it as an error.
    if kind == "error" and "status of 401" not in text:
        errors.append(f"console: {text}")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (scripts/bootstrap.sh installs it)")
    pytest.skip(reason)


@contextmanager
def chromium_page(profile: Path, width: int = 1600, height: int = 1000) -> Iterator[Page]:
    """A page in a fresh headless Chromium whose profile lives in ``profile``. Fails the
    test on a script error or a console error (a CSP violation among them)."""
    try:
        from playwright.sync_api import sync_playwright  # noqa: PLC0415  # optional driver
    except ImportError:
        _unavailable("Playwright's Python package is not installed (pip install -e .[dev])")
    exe = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    if exe is None:
        _unavailable(f"{CHROMIUM} is missing (apt-get install chromium)")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=exe,
            headless=True,
            args=FLAGS,
            viewport={"width": width, "height": height},
        )
        errors: list[str] = []
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.on("pageerror", lambda exc: errors.append(f"script error: {exc}"))
            page.on("console", lambda msg: _console(msg.type, msg.text, errors))
            yield page
        finally:
            context.close()
        assert not errors, errors
