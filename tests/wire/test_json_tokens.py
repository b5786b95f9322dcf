"""The JSON `token_ids` fast path against msgspec's exact decode.

Property: for any body, the fast path (a parse of the array's digits, used by
`decode_lookup`) and msgspec's decode into `list[int]` followed by the same token check
agree: the same tokens when the body is valid, a refusal from both when it is not. Valid
bodies are drawn with every JSON spacing; invalid ones by mutating valid ones and from a
list of the shapes the byte checks exist for. Each property holds for both parsers of the
digits: numpy's, and the compiled `_token_digits` (the installed one, or else the C
source built here with the C compiler, as `pip install` builds it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from unittest import mock

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from setuptools import Extension

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import MAX_TOKEN_ID, as_token_array
from kvatlas.wire import json_tokens
from kvatlas.wire.directory_api import LookupRequest, decode_lookup
from kvatlas.wire.json_tokens import PARSERS, DigitParser, compiled_parser, token_ids_array
from support.extensions import build_extension

JSON = "application/json"
_reference = msgspec.json.Decoder(LookupRequest)
C_SOURCE = Path(json_tokens.__file__).with_name("_token_digits.c")
PARSER_NAMES = ["numpy", "compiled"]


@pytest.fixture(scope="session")
def compiled_module(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The installed `_token_digits`, or the C source built here when it was not."""
    try:
        from kvatlas.wire import _token_digits  # noqa: PLC0415  # optional extension
    except ImportError:
        pass
    else:
        return _token_digits
    ext = Extension("_token_digits", [str(C_SOURCE)])
    return build_extension(ext, tmp_path_factory.mktemp("token_digits"))


@pytest.fixture(scope="session")
def parsers(compiled_module: ModuleType) -> dict[str, DigitParser]:
    """The installed parsers, and the compiled one built here when it was not installed."""
    if "compiled" in PARSERS:
        return PARSERS
    return {**PARSERS, "compiled": compiled_parser(compiled_module.parse)}


@contextmanager
def using(parser: DigitParser) -> Iterator[None]:
    """`decode_lookup` reads token arrays with ``parser``."""
    with mock.patch.object(json_tokens, "DEFAULT_PARSER", parser):
        yield


def reference(body: bytes) -> list[int] | None:
    """msgspec's exact decode and the token check; None: refused."""
    try:
        req = _reference.decode(body)
        if req.token_ids is None:
            return None
        return [int(t) for t in as_token_array(req.token_ids)]
    except (msgspec.MsgspecError, InvalidInput):
        return None


def pipeline(body: bytes) -> list[int] | None:
    """What the coordinator does: `decode_lookup` (fast path or not), the token check."""
    try:
        req = decode_lookup(body, JSON)
        if req.token_ids is not None:
            tokens: list[int] | bytes = req.token_ids
        elif req.tokens_b64 is not None:
            tokens = req.tokens_b64
        else:
            return None
        return [int(t) for t in as_token_array(tokens)]
    except InvalidInput:
        return None


# Every digit count, the edges of each, and the 8-digit words the parser reads.
token_st = st.one_of(
    st.integers(0, MAX_TOKEN_ID),
    st.integers(0, 12),
    st.integers(10**7 - 2, 10**8 + 2),
    st.integers(10**8 - 2, 10**9 + 2),
    st.integers(10**9 - 2, 10**9 + 2),
    st.integers(MAX_TOKEN_ID - 2, MAX_TOKEN_ID),
)
tokens_st = st.lists(token_st, max_size=200)
space_st = st.text(alphabet=" \t\n\r", max_size=2)


@st.composite
def bodies(draw: st.DrawFn, space_before_comma: bool = True) -> bytes:
    """A valid lookup body in any JSON spacing and field order (with no whitespace
    before a comma when ``space_before_comma`` is false: the shapes encoders write)."""
    tokens = draw(tokens_st)
    sep = (draw(space_st) if space_before_comma else "") + "," + draw(space_st)
    array = "[" + draw(space_st) + sep.join(map(str, tokens)) + draw(space_st) + "]"
    fields = [f'"token_ids"{draw(space_st)}:{draw(space_st)}{array}', '"model_name": "m"']
    if draw(st.booleans()):
        fields.append('"world_size": 2')
    order = draw(st.permutations(fields))
    return ("{" + ", ".join(order) + "}").encode()


@pytest.mark.parametrize("name", PARSER_NAMES)
@given(body=bodies(space_before_comma=False))
@settings(max_examples=300, deadline=None)
def test_valid_bodies_give_the_same_tokens_on_the_fast_path(
    parsers: dict[str, DigitParser], name: str, body: bytes
) -> None:
    want = reference(body)
    assert want is not None
    with using(parsers[name]):
        assert token_ids_array(body) is not None  # plain bodies take the fast path
        assert pipeline(body) == want


@pytest.mark.parametrize("name", PARSER_NAMES)
@given(body=bodies())
@settings(max_examples=300, deadline=None)
def test_every_valid_body_gives_the_same_tokens(
    parsers: dict[str, DigitParser], name: str, body: bytes
) -> None:
    """Whitespace before a comma is valid JSON that numpy's parse leaves to msgspec and
    the compiled one reads."""
    want = reference(body)
    assert want is not None
    with using(parsers[name]):
        if name == "compiled":
            assert token_ids_array(body) is not None
        assert pipeline(body) == want


@pytest.mark.parametrize("name", PARSER_NAMES)
@given(body=bodies(), data=st.data())
@settings(max_examples=500, deadline=None)
def test_mutated_bodies_are_refused_or_read_alike(
    parsers: dict[str, DigitParser], name: str, body: bytes, data: st.DataObject
) -> None:
    at = data.draw(st.integers(0, len(body)))
    junk = data.draw(
        st.sampled_from([b"-", b"0", b".5", b"e3", b",", b" ", b"[", b"]", b'"', b"\\", b"x"])
    )
    cut = data.draw(st.integers(0, 2))
    mutated = body[:at] + junk + body[at + cut :]
    with using(parsers[name]):
        assert pipeline(mutated) == reference(mutated)


@pytest.mark.parametrize(
    "array",
    [
        "[-1]",
        "[4294967296]",
        "[99999999999999999999999]",
        "[01, 2]",
        "[1.0]",
        "[1e3]",
        "[1,,2]",
        "[1 2]",
        "[,1]",
        "[1,]",
        "[[1]]",
        '["1"]',
        "[true]",
        "null",
        "[]",
        "[ ]",
        "[0, 4294967295]",
        "[4294967295, 4294967296]",
        "[9999999999]",
        "[12345678901]",
        "[0123456789]",
        "[012345678]",
        "[01234567]",
        "[00000000]",
        "[100000000, 1000000000]",
        "[00]",
        "[1 ,2]",
        "[1\t,2]",
        "[1, 2" + " " * 100 + "]",
        "[" + " " * 100 + "]",
        "[1,\n  2,\r\n\t3 ]",
    ],
)
@pytest.mark.parametrize("name", PARSER_NAMES)
def test_the_shapes_the_checks_exist_for(
    parsers: dict[str, DigitParser], name: str, array: str
) -> None:
    body = f'{{"token_ids": {array}, "model_name": "m"}}'.encode()
    with using(parsers[name]):
        assert pipeline(body) == reference(body)


@pytest.mark.parametrize("name", PARSER_NAMES)
@given(text=st.text(alphabet='0123456789, \t\n\r-+.eE[]"x', max_size=40))
@settings(max_examples=1000, deadline=None)
def test_any_array_text_is_read_alike_or_refused_by_both(
    parsers: dict[str, DigitParser], name: str, text: str
) -> None:
    """Whatever stands between the brackets, the fast path and msgspec agree."""
    body = f'{{"token_ids": [{text}], "model_name": "m"}}'.encode()
    with using(parsers[name]):
        assert pipeline(body) == reference(body)


def test_only_the_top_level_array_is_read() -> None:
    """Escapes anywhere, the key twice, a nested key or another form: msgspec decides."""
    cases = [
        b'{"extra": {"token_ids": [1, 2]}, "token_ids": [], "model_name": "m"}',
        b'{"extra": {"token_ids": [1, 2]}, "model_name": "m"}',
        b'{"token\\u005fids": [5], "model_name": "m"}',
        b'{"model_name": "a\\"token_ids\\": [1]", "token_ids": [7]}',
        b'{"token_ids": [1], "token_ids": [2], "model_name": "m"}',
        b'{"token_ids": [1], "tokens_b64": "AAAAAA==", "model_name": "m"}',
    ]
    for body in cases:
        assert pipeline(body) == reference(body), body
    assert token_ids_array(cases[0]) is None


@pytest.mark.parametrize("name", PARSER_NAMES)
@pytest.mark.parametrize("n", [32_768, 200_000])
def test_prompts_of_32k_and_200k_tokens(parsers: dict[str, DigitParser], name: str, n: int) -> None:
    """The second, over 1 MiB of JSON, the compiled parser reads without the GIL."""
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, 200_000, n)]
    for body in (
        json.dumps({"token_ids": tokens, "model_name": "m"}).encode(),
        msgspec.json.encode({"token_ids": tokens, "model_name": "m"}),
    ):
        got = token_ids_array(body, parsers[name])
        assert got is not None and got[0].tolist() == tokens
        with using(parsers[name]):
            assert pipeline(body) == tokens


@pytest.mark.parametrize("name", PARSER_NAMES)
@pytest.mark.parametrize(
    "array",
    [
        "[4294967295]",
        "[7]",
        "[12345678, 123456789]",
        "[" + ", ".join(["4294967295"] * 50) + "]",
        "[" + ", ".join(str(10**k) for k in range(10)) + "]",
        "[1" + "0" * 10 + "]",
    ],
)
def test_near_the_end_of_the_body_and_at_every_length(
    parsers: dict[str, DigitParser], name: str, array: str
) -> None:
    """The compiled parse reads 8 bytes at a time where the body has them, one at a time
    in its last 8 bytes: the array at the very end of the body takes the second way."""
    for body in (
        f'{{"model_name": "m", "token_ids": {array}}}'.encode(),
        f'{{"token_ids": {array}, "model_name": "m"}}'.encode(),
    ):
        with using(parsers[name]):
            assert pipeline(body) == reference(body), body


LayoutReader = Callable[[bytes, int, int], bytes | None]


@pytest.fixture(scope="session", params=["sse2", "avx512"])
def layout_reader(request: pytest.FixtureRequest, compiled_module: ModuleType) -> LayoutReader:
    """The compiled module's block readers (`parse_layout`): the SSE2 one where it was
    built, and its AVX-512 twin where the CPU has AVX-512 too."""
    reader: Callable[..., bytes | None] | None = getattr(compiled_module, "parse_layout", None)
    if reader is None:
        pytest.skip("the compiled parser has no block reader on this machine (no SSE2)")
    if request.param == "sse2":
        return reader
    if not compiled_module.HAVE_AVX512:
        pytest.skip("this CPU has no AVX-512 (F, BW, CD)")

    def avx512_reader(body: bytes, start: int, end: int) -> bytes | None:
        return reader(body, start, end, True)

    NEEDS_BYTES_BEFORE[avx512_reader] = 8
    return avx512_reader


NEEDS_BYTES_BEFORE: dict[Callable[..., object], int] = {}
"""Bytes a block reader needs before the span to answer: the AVX-512 reader reads each
number as the 8 bytes that end with its last digit (in a lookup body, the key and its
'[' are there)."""


def answers_layout(reader: LayoutReader, start: int) -> bool:
    """Whether ``reader`` answers every encoder layout at this span start."""
    return start >= NEEDS_BYTES_BEFORE.get(reader, 0)


# What encoders write: "," (compact) or ", " (Python's json.dumps) between numbers.
layout_tokens_st = st.lists(st.one_of(st.integers(0, 9_999_999), token_st), max_size=400)


@st.composite
def layout_bodies(draw: st.DrawFn) -> tuple[bytes, int, int]:
    """A body in an encoder's layout, with the span of its array."""
    tokens = draw(layout_tokens_st)
    sep = draw(st.sampled_from([",", ", "]))
    lead = draw(st.sampled_from(["", '{"model_name": "m", "token_ids": ', '{"token_ids":']))
    array = "[" + draw(space_st) + sep.join(map(str, tokens)) + draw(space_st) + "]"
    tail = draw(st.sampled_from(["", "}", ', "model_name": "m"}']))
    body = (lead + array + tail).encode()
    return body, len(lead) + 1, len(lead) + len(array) - 1


@given(case=layout_bodies())
@settings(max_examples=500, deadline=None)
def test_the_block_reader_reads_every_encoder_layout_exactly(
    layout_reader: LayoutReader, case: tuple[bytes, int, int]
) -> None:
    """Numbers of up to 7 digits in "," or ", " layout: the block reader answers, with
    the tokens msgspec reads; a longer number (or none: `parse` answers an empty array
    itself) sends it to the general reader."""
    body, start, end = case
    want = msgspec.json.decode(b"[" + body[start:end] + b"]", type=list[int])
    got = layout_reader(body, start, end)
    if want and all(t < 10**7 for t in want) and answers_layout(layout_reader, start):
        assert got is not None
    if got is not None:
        assert np.frombuffer(got, dtype="<u4").tolist() == want


@given(case=layout_bodies(), data=st.data())
@settings(max_examples=1000, deadline=None)
def test_the_block_reader_answers_only_what_msgspec_reads_alike(
    layout_reader: LayoutReader,
    case: tuple[bytes, int, int],
    data: st.DataObject,
) -> None:
    """Mutated layouts (a byte added, removed or replaced anywhere in the array): where
    the block reader answers, msgspec reads the same tokens (below 2**32)."""
    body, start, end = case
    at = data.draw(st.integers(start, end))
    junk = data.draw(
        st.sampled_from([b"-", b"0", b"00", b".5", b"e3", b",", b" ", b"  ", b"\t", b"x", b""])
    )
    cut = data.draw(st.integers(0, 2))
    mutated = body[:at] + junk + body[min(at + cut, end) :]
    new_end = end + len(junk) - (min(at + cut, end) - at)
    got = layout_reader(mutated, start, new_end)
    if got is None:
        return
    want = msgspec.json.decode(b"[" + mutated[start:new_end] + b"]", type=list[int])
    assert np.frombuffer(got, dtype="<u4").tolist() == want
    assert max(want, default=0) <= MAX_TOKEN_ID


@pytest.mark.parametrize(
    "array",
    ["1,,2", "1 ,2", "1, ,2", ",1", "1,", " ,1", "01,2", "1,00", "1,  2", "1 2", "1,-2", "1,2x"],
)
def test_the_block_reader_leaves_other_shapes_to_the_general_reader(
    layout_reader: LayoutReader, array: str
) -> None:
    body = f'{{"token_ids": [{array}], "model_name": "m"}}'.encode()
    start = body.index(b"[") + 1
    assert layout_reader(body, start, body.index(b"]")) is None


def test_the_block_reader_crosses_its_64_byte_blocks(layout_reader: LayoutReader) -> None:
    """Numbers at every offset against the block edges, in both layouts, and the array
    at every distance from the body's end (the last 8 bytes are read one at a time)."""
    reader = layout_reader
    for shift in range(70):
        for sep in (",", ", "):
            tokens = [1234567, *range(shift), 89, 7654321]
            array = "[" + sep.join(map(str, tokens)) + "]"
            body = ('{"token_ids": ' + array + " " * (shift % 10) + "}").encode()
            start = body.index(b"[") + 1
            got = reader(body, start, body.index(b"]"))
            assert got is not None and np.frombuffer(got, dtype="<u4").tolist() == tokens


@pytest.mark.parametrize("sep", [",", ", "])
@pytest.mark.parametrize("high", [10, 1000, 10**7])
def test_the_block_reader_over_many_batches(
    layout_reader: LayoutReader, sep: str, high: int
) -> None:
    """Thousands of numbers: single digits (32 to a 64-byte word, more than it takes at
    once) up to 7 digits, across many of its 2 KiB batches."""
    tokens = [int(t) for t in np.random.default_rng(high).integers(0, high, 5000)]
    body = ('{"token_ids": [' + sep.join(map(str, tokens)) + "]}").encode()
    got = layout_reader(body, body.index(b"[") + 1, body.index(b"]"))
    assert got is not None and np.frombuffer(got, dtype="<u4").tolist() == tokens


def test_the_block_readers_answer_alike_where_a_span_starts_inside_a_number(
    layout_reader: LayoutReader,
) -> None:
    """The span is what the caller says, even mid-number: digits before it are not
    the first number's (the AVX-512 reader reads 8 bytes back from each number's end)."""
    body = b'{"token_ids": [12345678, 5, 9876543, 123456789]}'
    at = body.index(b"1234")
    for start, want in ((at + 4, [5678, 5, 9876543]), (at + 1, [2345678, 5, 9876543])):
        end = body.index(b", 123456789")
        got = layout_reader(body, start, end)
        assert got is not None and np.frombuffer(got, dtype="<u4").tolist() == want
    # 9 digits: the block readers leave it to the general reader, which parse uses.
    assert layout_reader(body, at, body.index(b"]")) is None


@pytest.mark.parametrize("digits", [1, 5, 7, 8])
def test_the_block_readers_at_each_number_length(layout_reader: LayoutReader, digits: int) -> None:
    """Every number of one length, 8 digits (the most the AVX-512 reader converts) too."""
    rng = np.random.default_rng(digits)
    low = 10 ** (digits - 1) if digits > 1 else 0
    tokens = [int(t) for t in rng.integers(low, 10**digits, 3000)]
    for sep in (",", ", "):
        body = ('{"token_ids": [' + sep.join(map(str, tokens)) + "]}").encode()
        got = layout_reader(body, body.index(b"[") + 1, body.index(b"]"))
        if got is None:  # the SSE2 reader leaves 8 digits to the general reader
            assert digits == 8
            continue
        assert np.frombuffer(got, dtype="<u4").tolist() == tokens


def test_the_block_readers_refuse_a_number_longer_than_their_batch(
    layout_reader: LayoutReader,
) -> None:
    """3,000 digits (more than one 2 KiB batch holds), alone and among short numbers."""
    for array in ("9" * 3000, "1, " + "9" * 3000 + ", 2", "1," * 700 + "9" * 3000):
        body = f'{{"token_ids": [{array}]}}'.encode()
        assert layout_reader(body, body.index(b"[") + 1, body.index(b"]")) is None


@given(tokens=layout_tokens_st, sep=st.sampled_from([",", ", "]), lead=st.integers(0, 12))
@settings(max_examples=200, deadline=None)
def test_parse_answers_alike_whichever_block_reader_it_picks(
    compiled_module: ModuleType, tokens: list[int], sep: str, lead: int
) -> None:
    """`parse` picks the AVX-512 reader only with 8 bytes before the span (else the SSE2
    one, also on a CPU with AVX-512): the same tokens either way."""
    body = (" " * lead + "[" + sep.join(map(str, tokens)) + "]").encode()
    got = compiled_module.parse(body, lead + 1, len(body) - 1)
    assert got is not None and np.frombuffer(got, dtype="<u4").tolist() == tokens
