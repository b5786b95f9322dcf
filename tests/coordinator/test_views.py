"""`views.lookup_json` writes a lookup answer by hand for speed; it must be byte for
byte what msgspec makes of the `LookupResponse` Structs, whatever the namespace text
(quotes, backslashes, non-ASCII), placements, access counts and tokens."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.views import holders_wire, lookup_json, prefix_response
from kvatlas.core.coordinator.placements import Placement, PrefixHolder, PrefixResult
from kvatlas.core.keys import Namespace
from kvatlas.core.types import ChunkHash, InstanceId, Tier

_text = st.text(max_size=12)
_placement = st.builds(
    Placement,
    _text,
    st.integers(0, 2**40),
    st.sampled_from(list(Tier)),
    _text,
    st.integers(0, 2**40),
    st.booleans(),
)


@st.composite
def _results(draw: st.DrawFn) -> PrefixResult:
    ns = Namespace(draw(_text), draw(st.integers(0, 2**32)), draw(st.integers(0, 9)), draw(_text))
    n = draw(st.integers(0, 12))
    pool = draw(st.lists(st.lists(_placement, max_size=3).map(tuple), min_size=1, max_size=4))
    placements = tuple(draw(st.sampled_from(pool)) for _ in range(n))
    counts = draw(st.sampled_from([(0,) * n, tuple(draw(st.integers(0, 5)) for _ in range(n))]))
    tokens = draw(
        st.one_of(
            st.none(),
            st.just((None,) * n),
            st.lists(
                st.one_of(st.none(), st.lists(st.integers(0, 2**32 - 1), max_size=4).map(tuple)),
                min_size=n,
                max_size=n,
            ).map(tuple),
        )
    )
    hashes = tuple(ChunkHash(draw(st.binary(min_size=32, max_size=32))) for _ in range(n))
    holders = tuple(
        PrefixHolder(
            InstanceId(draw(_text)), draw(st.sampled_from(list(Tier))), draw(st.integers(0, n))
        )
        for _ in range(draw(st.integers(0, 2)))
    )
    return PrefixResult(ns, hashes, placements, counts, tokens, holders)


@settings(max_examples=300, deadline=None)
@given(_results())
def test_lookup_json_is_what_msgspec_writes(res: PrefixResult) -> None:
    expected = msgspec.json.encode(prefix_response(res, 256))
    got = lookup_json([h.hex() for h in res.hashes], res.namespace, res, holders_wire(res, 256))
    assert got == expected
    msgspec.json.decode(got)  # and it is JSON
