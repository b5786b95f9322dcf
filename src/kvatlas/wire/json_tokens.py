"""The JSON ``token_ids`` array of a lookup body, read without building Python ints.

LMCache's clients ask `POST /directory/lookup` with the prompt as a JSON integer array:
32,768 tokens are ~240 KB of digits, and msgspec's exact decode into a ``list[int]``
builds 32,768 Python ints (~1 ms here) that hashing then packs back into a uint32 array.
`token_ids_array` reads the array's digits straight into that uint32 array with one C
parse (numpy's text reader) after byte-level checks that make it exact: it answers only
for a body it can prove msgspec would read as the same request with the same tokens,
and None for anything else (escapes anywhere, the key twice, a value that is not a plain
array of non-negative JSON integers below 2**32, leading zeros, ...), which the caller
then decodes with msgspec as before, errors and all.

Owns this parse only: no I/O, no state, no validation beyond the tokens' own.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvatlas.core.keys import MAX_TOKEN_ID

_KEY = b'"token_ids"'
_JSON_SPACE = b" \t\n\r"
_ZERO, _NINE, _COMMA, _SPACE = 48, 57, 44, 32


def token_ids_array(body: bytes) -> tuple[npt.NDArray[np.uint32], bytes] | None:
    """The tokens of ``body``'s top-level ``token_ids`` array as uint32, and the body
    with that array emptied (``[]``, for the caller to decode the other fields); None
    when the fast path cannot prove the answer (the caller decodes ``body`` as usual).

    The caller must check that the emptied body decodes with ``token_ids == []``: with
    no backslash in the body (so no key is escaped) and ``"token_ids"`` once, that
    proves the array was the top-level one.
    """
    at = body.find(_KEY)
    if at < 0 or b"\\" in body or body.count(_KEY) != 1:
        return None
    open_at = body.find(b"[", at + len(_KEY))
    if open_at < 0 or body[at + len(_KEY) : open_at].strip(_JSON_SPACE) != b":":
        return None
    close_at = body.find(b"]", open_at)
    if close_at < 0:
        return None
    tokens = _parse_digits(body, open_at + 1, close_at)
    if tokens is None:
        return None
    return tokens, body[: open_at + 1] + body[close_at:]


def _parse_digits(body: bytes, start: int, end: int) -> npt.NDArray[np.uint32] | None:
    """The comma-separated JSON integers in ``body[start:end]``, or None unless each is
    a plain non-negative integer below 2**32 (digits only, no leading zero)."""
    raw = np.frombuffer(body, dtype=np.uint8, count=end - start, offset=start)
    digit = (raw - np.uint8(_ZERO)) <= _NINE - _ZERO
    digits = int(np.count_nonzero(digit))
    commas = int(np.count_nonzero(raw == _COMMA))
    spaces = int(np.count_nonzero(raw == _SPACE))
    if digits + commas + spaces != raw.size:
        others = sum(int(np.count_nonzero(raw == c)) for c in b"\t\n\r")
        if digits + commas + spaces + others != raw.size:
            return None  # a sign, a point, an exponent, a quote, a bracket: not ours
    if digits == 0:
        return np.empty(0, dtype=np.uint32) if commas == 0 else None
    # One run of digits per comma-separated field ("1 2" is two runs in one field), and
    # no run that starts with a 0 and goes on (JSON has no leading zeros).
    runs = int(np.count_nonzero(digit[1:] & ~digit[:-1])) + bool(digit[0])
    zero_first = (raw[:-1] == _ZERO) & digit[1:]  # a 0 followed by a digit ...
    zero_first[1:] &= ~digit[:-2]  # ... that starts its run
    if runs != commas + 1 or zero_first.any():
        return None
    try:
        values = np.fromstring(body[start:end], dtype=np.int64, sep=",")
    except ValueError:  # a field the checks above let through that is not one integer
        return None
    # Digits beyond 2**32-1 read as more than it (int64 saturates above its range).
    if values.size != runs or int(values.max()) > MAX_TOKEN_ID:
        return None
    return values.astype("<u4")
