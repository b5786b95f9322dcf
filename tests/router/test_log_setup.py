"""Issue #38 item 5f: the services' log setup keeps httpx's per-request INFO line
("HTTP Request: ...") out of their logs, unless asked for DEBUG."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvatlas.cli.log_setup import configure_logging


@pytest.fixture
def restore() -> Iterator[None]:
    root, httpx_log = logging.getLogger(), logging.getLogger("httpx")
    saved = root.level, httpx_log.level
    yield
    root.setLevel(saved[0])
    httpx_log.setLevel(saved[1])


@pytest.mark.usefixtures("restore")
def test_httpx_request_lines_are_quiet_at_info() -> None:
    logging.getLogger().setLevel(logging.INFO)  # basicConfig leaves pytest's root alone
    assert configure_logging("kvatlas router", "info")
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)


@pytest.mark.usefixtures("restore")
def test_httpx_request_lines_show_at_debug() -> None:
    assert configure_logging("kvatlas router", "DEBUG")
    assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
