"""The Mooncake trace loader: validation errors that name the line, windows, the vendored
trace, and the block token runs (deterministic, prefix-chaining)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest

from kvatlas.core.errors import InvalidInput
from kvatlas.evaluation.trace.mooncake import (
    TraceError,
    TraceRequest,
    block_token_ids,
    bundled_conversation_trace,
    bundled_trace_path,
    load_trace,
    parse_trace,
    prompt_token_ids,
)

ROOT = Path(__file__).resolve().parents[2]


def line(ts: int = 0, inp: int = 600, out: int = 5, ids: list[int] | None = None) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids or [0, 1]}
    )


def test_parse_good_lines_and_blank_lines() -> None:
    t = parse_trace([line(0), "", line(1500, 512, 0, [7]), "  \n"], source="t.jsonl")
    assert len(t) == 2
    assert t.requests[1] == TraceRequest(1500, 512, 0, (7,), 3)
    assert t.requests[0].block_lengths(512) == [512, 88]
    assert t.duration_s == 1.5
    assert t.input_tokens == 1112


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("{not json", "not a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "hash_ids"),
        (line(ts=-1), "timestamp -1 is negative"),
        (line(inp=0, ids=[0]), "input_length 0"),
        (line(out=-2), "output_length -2"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}', "empty"),
        (line(ids=[0, -3]), "negative id -3"),
        (line(inp=1025, ids=[0, 1]), "does not fit 2 blocks"),
        (line(inp=512, ids=[0, 1]), "does not fit 2 blocks"),
        ('{"timestamp": "0", "input_length": 5, "output_length": 1, "hash_ids": [0]}', "int"),
        ('{"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": [0]}', "int"),
    ],
)
def test_bad_line_is_refused_naming_it(bad: str, words: str) -> None:
    with pytest.raises(TraceError) as err:
        parse_trace([line(0), line(0), bad], source="x.jsonl")
    assert "x.jsonl:3" in str(err.value)
    assert words in str(err.value)
    assert isinstance(err.value, InvalidInput)


def test_out_of_order_and_empty_traces_are_refused() -> None:
    with pytest.raises(TraceError, match=r"x:2: timestamp 5 is before .* 9"):
        parse_trace([line(9), line(5)], source="x")
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "\n"], source="x")


def test_block_tokens_flag_changes_the_fit() -> None:
    t = parse_trace([line(inp=300, ids=[0, 1, 2])], block_tokens=128)
    assert t.block_tokens == 128
    with pytest.raises(TraceError, match="--trace-block-tokens"):
        parse_trace([line(inp=300, ids=[0, 1, 2])])


def test_load_trace_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "t.jsonl").write_text(line(0, inp=12) + "\n" + line(3, inp=9, ids=[5]) + "\n")
    with pytest.raises(TraceError, match=r"t.jsonl:2: input_length 9 does not fit 1 blocks"):
        load_trace(tmp_path / "t.jsonl", block_tokens=8)


def test_window_keeps_arrivals_in_range() -> None:
    t = parse_trace([line(0), line(999), line(1000), line(2500), line(3000)])
    w = t.window(1.0, 2.0)
    assert [r.timestamp_ms for r in w.requests] == [1000, 2500]
    assert w.block_tokens == t.block_tokens
    with pytest.raises(TraceError):
        t.window(0.0, 0.0)


def test_vendored_trace_loads_and_ships() -> None:
    path = bundled_trace_path()
    assert path.is_file()
    assert (path.parent / "LICENSE-APACHE").is_file()
    assert "Apache" in (path.parent / "README.md").read_text()
    t = bundled_conversation_trace()
    assert len(t) == 12_031
    assert t.block_tokens == 512
    assert round(t.input_tokens / len(t)) == 12_035
    assert 3500 < t.duration_s < 3600
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "evaluation/trace/data/*" in data["tool"]["setuptools"]["package-data"]["kvatlas"]


def test_block_token_ids_are_deterministic_and_distinct() -> None:
    a = block_token_ids(42, 512, 49152)
    assert a.dtype == np.uint32
    assert a.shape == (512,)
    assert int(a.max()) < 49152
    assert np.array_equal(a, block_token_ids(42, 512, 49152))
    assert np.array_equal(block_token_ids(42, 100, 49152), a[:100])
    b = block_token_ids(43, 512, 49152)
    assert np.mean(a == b) < 0.01
    # a fixed value, so that a change of the mapping is a visible decision
    assert block_token_ids(0, 4, 1 << 32).tolist() == [
        2065550767, 2298633409, 479680206, 3674312685,
    ]  # fmt: skip
    assert block_token_ids(7, 3, 49152).tolist() == [9627, 46905, 26751]
    with pytest.raises(TraceError):
        block_token_ids(1 << 41, 4, 100)


def test_prompts_chain_prefixes_as_the_trace_says() -> None:
    r1 = TraceRequest(0, 1300, 1, (0, 1, 2))
    r2 = TraceRequest(0, 1536, 1, (0, 1, 9))
    r3 = TraceRequest(0, 700, 1, (0, 5))
    p1, p2, p3 = (prompt_token_ids(r, 512, 49152) for r in (r1, r2, r3))
    assert p1.dtype == np.uint32
    assert (len(p1), len(p2), len(p3)) == (1300, 1536, 700)
    assert np.array_equal(p1[:1024], p2[:1024])
    assert not np.array_equal(p1[1024:1300], p2[1024:1300])
    assert np.array_equal(p1[:512], p3[:512])
    assert not np.array_equal(p1[512:700], p3[512:700])
    want = np.concatenate([block_token_ids(h, 512, 49152) for h in r1.hash_ids])[:1300]
    assert np.array_equal(p1, want)
