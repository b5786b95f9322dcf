"""Types of the compiled blake3 prefix chain (`_chain.c`): any buffer is taken; these
are the ones kvatlas passes."""

import numpy as np
import numpy.typing as npt

def chain(
    tokens: bytes | npt.NDArray[np.uint32],
    chunk_size: int,
    prefix: bytes,
    memo: ChainMemo | None = None,
    /,
) -> bytes: ...

class ChainMemo:
    def __init__(self, chunk_size: int, max_bytes: int, seed: bytes) -> None: ...
    @property
    def chunk_size(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def clear(self) -> None: ...
