"""The shared-token gate: the right token passes in every form it arrives in, anything
else is refused, and nothing it is offered makes it raise."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvatlas.runtime.auth import TokenGate

TOKENS = ["s3cret", "é", "клю́ч", "tab\tand space"]


@pytest.mark.parametrize("token", TOKENS)
def test_the_token_passes_as_text_and_as_bytes(token: str) -> None:
    gate = TokenGate(token)
    raw = token.encode()
    assert gate.required
    assert gate.check(token)
    assert gate.check(raw)
    assert gate.check(bytearray(raw))
    assert gate.check(memoryview(raw))
    header = b"Bearer " + raw
    assert gate.check_header(header)
    # HTTP servers hand header values over decoded as latin-1: the same bytes.
    assert gate.check_header(header.decode("latin-1"))
    if token.isascii():
        assert gate.check_header(f"Bearer {token}")


@pytest.mark.parametrize(
    "offered",
    [
        "",
        "s3cre",
        "s3cret ",
        "S3CRET",
        "é",
        "\udcff",
        b"\xff\xfe",
        b"s3cret\x00",
        None,
        0,
        1.5,
        ["s3cret"],
        object(),
    ],
)
def test_anything_else_is_refused(offered: Any) -> None:
    gate = TokenGate("s3cret")
    assert not gate.check(offered)
    assert not gate.check_header(offered)


def test_a_header_must_be_a_bearer_of_the_token() -> None:
    gate = TokenGate("s3cret")
    assert not gate.check_header("s3cret")
    assert not gate.check_header("Basic s3cret")
    assert not gate.check_header("Bearer  s3cret")
    assert not gate.check_header("Bearer é")
    assert not gate.check_header("Bearer é".encode())


@pytest.mark.parametrize("token", [None, ""])
def test_no_token_lets_everything_through(token: str | None) -> None:
    gate = TokenGate(token)
    assert not gate.required
    for offered in (None, "", "anything", b"\xff", 3):
        assert gate.check(offered)
        assert gate.check_header(offered)


_ANY = st.one_of(
    st.none(),
    st.text(),
    st.binary(),
    st.integers(),
    st.floats(),
    st.lists(st.text(), max_size=3),
    st.text().map(lambda t: "Bearer " + t),
)


@given(token=st.text(min_size=1), offered=_ANY)
def test_the_gate_never_raises(token: str, offered: object) -> None:
    gate = TokenGate(token)
    assert isinstance(gate.check(offered), bool)
    assert isinstance(gate.check_header(offered), bool)
