"""Types of the compiled JSON token parser (`_token_digits.c`)."""

def parse(body: bytes | bytearray, start: int, end: int, /) -> bytes | None: ...

HAVE_AVX512: int
"""1 where the CPU has AVX-512 F, BW and CD: `parse` then reads encoders' layouts with
the AVX-512 block reader."""

def parse_layout(
    body: bytes | bytearray, start: int, end: int, avx512: bool = False, /
) -> bytes | None:
    """For tests, where built with SSE2 (x86-64): the block reader alone (its AVX-512
    twin with ``avx512``, where `HAVE_AVX512`)."""
