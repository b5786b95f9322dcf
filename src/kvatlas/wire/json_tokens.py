"""The JSON ``token_ids`` array of a lookup body, read without building Python ints.

LMCache's clients ask `POST /directory/lookup` with the prompt as a JSON integer array:
32,768 tokens are ~200 KB of digits, and msgspec's exact decode into a ``list[int]``
builds 32,768 Python ints that hashing then packs back into a uint32
array. `token_ids_array` reads the array straight into that uint32 array. Two parsers
of the digits answer alike (a hypothesis test holds them to msgspec): the compiled
`kvatlas.wire._token_digits` (with an AVX-512 path where the CPU has it, SSE2
else), built by ``pip install`` where a C compiler is found,
and `_parse_digits`, a fixed number of numpy passes with no per-token Python work
(each number is the 8 bytes before its comma read as one little-endian word,
converted by SWAR arithmetic), which serves where it was not built.
`token_ids_array` answers only for a body it can prove msgspec would read as the same
request with the same tokens, and None for anything else (escapes anywhere, the key
twice, a value that is not a plain array of non-negative JSON integers below 2**32,
leading zeros, ...), which the caller then decodes with msgspec as before, errors and
all.

Owns this parse only: no I/O, no state, no validation beyond the tokens' own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from kvatlas.core.keys import MAX_TOKEN_ID

_compiled_parse: Callable[[bytes | bytearray, int, int], bytes | None] | None
try:
    from kvatlas.wire._token_digits import HAVE_AVX512 as _HAVE_AVX512
    from kvatlas.wire._token_digits import parse as _compiled_parse
except ImportError:  # installed without a C compiler: the numpy parse serves alone
    _compiled_parse = None
    _HAVE_AVX512 = 0

DigitParser = Callable[[bytes | bytearray, int, int], npt.NDArray[np.uint32] | None]
"""Reads ``body[start:end]``, the inside of a JSON array, into uint32 tokens; None
unless the span is exactly plain non-negative integers below 2**32 and commas."""

_KEY = b'"token_ids"'
_JSON_SPACE = b" \t\n\r"
_COMMA, _SPACE = 44, 32
_MAX_TRAILING_SPACE = 64
"""Whitespace after the last number the fast path walks back over (byte by byte)."""

_U64 = np.uint64
_ZEROS: Final = _U64(0x3030303030303030)  # "0" in every byte
_PAST_NINE: Final = _U64(0x7676767676767676)  # + this sets a byte's top bit if it is > 9
_TOPS: Final = _U64(0x8080808080808080)
_NIBBLES: Final = _U64(0x0F0F0F0F0F0F0F0F)
_LEAST: Final = np.array([0, 10**6, 10**5, 10**4, 10**3, 100, 10, 0, 2**64 - 1], dtype=np.uint64)
"""The least value a number may have by how many of its word's 8 bytes are not its
digits: a JSON integer of n > 1 digits has no leading zero, and a word with no digit
(8) is no number at all. A word of 8 digits (0) may be the end of a longer number:
`_longer_numbers` judges it."""


def token_ids_array(
    body: bytes | bytearray, parse: DigitParser | None = None
) -> tuple[npt.NDArray[np.uint32], bytes | bytearray] | None:
    """The tokens of ``body``'s top-level ``token_ids`` array as uint32, and the body
    with that array emptied (``[]``, for the caller to decode the other fields); None
    when the fast path cannot prove the answer (the caller decodes ``body`` as usual).

    The caller must check that the emptied body decodes with ``token_ids == []``: with
    no backslash in the body (so no key is escaped) and ``"token_ids"`` once, that
    proves the array was the top-level one. ``parse``: the parser of the digits,
    `DEFAULT_PARSER` unless given (tests hold each to msgspec).
    """
    at = body.find(_KEY)
    if at < 0:
        return None
    open_at = body.find(b"[", at + len(_KEY))
    if open_at < 0 or body[at + len(_KEY) : open_at].strip(_JSON_SPACE) != b":":
        return None
    close_at = body.find(b"]", open_at)
    if close_at < 0:
        return None
    # The array itself holds only digits, commas and whitespace once `_parse_digits`
    # says yes: a backslash or the key again can only be outside it.
    if b"\\" in body[:open_at] or body.find(b"\\", close_at) >= 0 or body.find(_KEY, close_at) >= 0:
        return None
    tokens = (parse or DEFAULT_PARSER)(body, open_at + 1, close_at)
    if tokens is None:
        return None
    return tokens, body[: open_at + 1] + body[close_at:]


def compiled_parser(
    parse: Callable[[bytes | bytearray, int, int], bytes | None],
) -> DigitParser:
    """The `DigitParser` of `_token_digits.parse` (or of that module built elsewhere):
    its bytes as a uint32 array, a view without a copy (whose ``base`` is those bytes,
    which `decode_lookup` passes on as they are)."""

    def parse_array(body: bytes | bytearray, start: int, end: int) -> npt.NDArray[np.uint32] | None:
        raw = parse(body, start, end)
        return None if raw is None else np.frombuffer(raw, dtype="<u4")

    return parse_array


def _parse_digits(body: bytes | bytearray, start: int, end: int) -> npt.NDArray[np.uint32] | None:
    """The comma-separated JSON integers in ``body[start:end]``, or None unless the
    span is exactly ``ws* N , ws* N , ... ws* N ws*`` (or only whitespace) with each N
    a plain non-negative integer below 2**32 (digits only, no leading zero).

    ``body[start - 1]`` must be a byte that is not a digit (the array's ``[``) with at
    least 10 bytes before it (the key): every word read below lies inside ``body``.
    """
    n = end - start
    raw = np.frombuffer(body, dtype=np.uint8, count=n, offset=start)
    mask = raw == _COMMA
    commas = np.flatnonzero(mask)
    np.equal(raw, _SPACE, out=mask)
    spaces = int(np.count_nonzero(mask))
    count = commas.size + 1  # numbers, if the span holds any
    last = end  # the end of the last number: the span without its trailing whitespace
    while last > start and body[last - 1] in _JSON_SPACE:
        last -= 1
        if end - last > _MAX_TRAILING_SPACE:
            return None
    if last == start:
        return np.empty(0, dtype=np.uint32) if count == 1 else None
    # Each number ends right before its comma (or at `last`): the 8 bytes before that,
    # as a little-endian word, hold its last 8 digits with the last digit on top.
    ends = np.empty(count, dtype=np.int64)
    np.add(commas, start, out=ends[:-1])
    ends[-1] = last
    x = _words_before(body, ends)
    x ^= _ZEROS  # digits become 0-9, every other byte something above 9
    junk = x + _PAST_NINE
    junk |= x
    junk &= _TOPS  # the top bit of every byte that is not a digit
    # A byte below a non-digit is not this number's either: smear each flag down.
    junk |= junk >> _U64(8)
    junk |= junk >> _U64(16)
    junk |= junk >> _U64(32)
    others = np.bitwise_count(junk)  # bytes of the word that are not the number's
    junk >>= _U64(7)
    junk *= _U64(0x0F)
    junk ^= _NIBBLES  # 0x0F on the number's bytes, 0 elsewhere
    x &= junk
    # Eight digits (leading bytes zero) to their value in three multiply-shift steps.
    x *= _U64(2561)
    x >>= _U64(8)
    x &= _U64(0x00FF00FF00FF00FF)
    x *= _U64(6553601)
    x >>= _U64(16)
    x &= _U64(0x0000FFFF0000FFFF)
    x *= _U64(42949672960001)
    x >>= _U64(32)
    if (x < _LEAST[others]).any():
        return None  # an empty field ("1,,2", "[1,]", "1 ,2") or a leading zero
    digits = 8 * count - int(others.sum(dtype=np.int64))
    full = np.flatnonzero(others == 0)
    if full.size:  # eight digits in the word: the number may go on below it
        longer = _longer_numbers(body, ends[full], x[full])
        if longer is None:
            return None
        x[full], more = longer
        digits += more
    # The numbers' digits, the commas and the spaces are the whole span only if no
    # byte is anything else and every digit belongs to a number counted above.
    used = digits + commas.size + spaces
    if used != n:
        for c in b"\t\n\r":
            np.equal(raw, c, out=mask)
            used += int(np.count_nonzero(mask))
        if used != n:
            return None
    return x.astype("<u4")


def _words_before(body: bytes | bytearray, ends: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """The 8 bytes before each of ``ends`` as a little-endian word, from two aligned
    reads and a funnel shift (numpy would first copy an unaligned view whole)."""
    padded = np.frombuffer(body + bytes(16 - len(body) % 8), dtype="<u8")
    at = ends - 8
    shift = at.view(np.uint64) & _U64(7)
    shift <<= _U64(3)
    at >>= 3
    words = padded.take(at)
    words >>= shift
    at += 1
    high = padded.take(at)
    # high << (64 - shift) in two steps: for a shift of 0 it must give 0.
    high <<= _U64(1)
    np.subtract(_U64(63), shift, out=shift)
    high <<= shift
    words |= high
    return words


def _longer_numbers(
    body: bytes | bytearray, ends: npt.NDArray[np.int64], low: npt.NDArray[np.uint64]
) -> tuple[npt.NDArray[np.uint64], int] | None:
    """The values of the numbers ending at ``ends`` whose last 8 digits are ``low``
    (JSON allows 9 and 10 digits below 2**32), and the digits found beyond those 8;
    None for a leading zero, 11 digits or more, or a value of 2**32 or more."""
    whole = np.frombuffer(body, dtype=np.uint8)
    ninth = whole[ends - 9] - np.uint8(48)
    tenth = whole[ends - 10] - np.uint8(48)
    has9 = ninth <= 9
    has10 = has9 & (tenth <= 9)
    if (has10 & (whole[ends - 11] - np.uint8(48) <= 9)).any():
        return None
    high = np.where(has9, ninth, 0).astype(np.uint64)
    high += np.where(has10, tenth, 0).astype(np.uint64) * _U64(10)
    value = low + high * _U64(10**8)
    least = np.where(has10, 10**9, np.where(has9, 10**8, 10**7)).astype(np.uint64)
    if (value < least).any() or int(value.max()) > MAX_TOKEN_ID:
        return None
    return value, int(has9.sum(dtype=np.int64) + has10.sum(dtype=np.int64))


PARSERS: Final[dict[str, DigitParser]] = {"numpy": _parse_digits}
if _compiled_parse is not None:
    PARSERS["compiled"] = compiled_parser(_compiled_parse)
"""The digit parsers this installation has, by name."""
DEFAULT_PARSER_NAME: Final = "compiled" if "compiled" in PARSERS else "numpy"
"""The parser `token_ids_array` uses: the compiled one where it was built."""
DEFAULT_PARSER: Final = PARSERS[DEFAULT_PARSER_NAME]
DEFAULT_PARSER_READER: Final = (
    "numpy"
    if _compiled_parse is None
    else "compiled, AVX-512 block reader"
    if _HAVE_AVX512
    else "compiled, SSE2 block reader"
)
"""What reads encoders' layouts here, for the coordinator's start-up log."""
