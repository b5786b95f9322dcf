"""Types of the compiled JSON token parser (`_token_digits.c`)."""

def parse(body: bytes | bytearray, start: int, end: int, /) -> bytes | None: ...
def parse_layout(body: bytes | bytearray, start: int, end: int, /) -> bytes | None:
    """For tests, where built with SSE2 (x86-64): the block reader alone."""
