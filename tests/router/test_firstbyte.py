"""The first-byte deadline's arithmetic (`router.firstbyte`): learned from waits for a
first byte, floored and capped, run from the last progress, only while work waits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvatlas.core.errors import ConfigError
from kvatlas.router.config import RouterConfig, StaticEngine
from kvatlas.router.firstbyte import DECAY, FirstByteWatch, overdue


def test_the_deadline_is_learned_floored_and_capped() -> None:
    w = FirstByteWatch()
    assert w.deadline_s(2.0, 4.0, 600.0) == 2.0  # nothing learned: the floor
    w.first_byte(3.0, now=10.0)
    assert w.deadline_s(2.0, 4.0, 600.0) == 12.0
    assert w.deadline_s(2.0, 4.0, 10.0) == 10.0  # the engine timeout caps it
    w.first_byte(0.1, now=11.0)  # a fast answer: the slow one is forgotten slowly
    assert w.learned_s == 3.0 * DECAY


def test_progress_is_a_byte_or_a_counter_that_moved() -> None:
    w = FirstByteWatch()
    w.began(idle=True, now=5.0)
    w.began(idle=False, now=9.0)  # work already in flight: the silence goes on
    assert w.last_progress == 5.0
    counters = {"kvatlas_engine_generation_tokens_total": 7.0}
    w.probed(counters, now=6.0)  # the first reading: nothing to compare with
    w.probed(counters, now=7.0)
    w.probed({}, now=7.5)  # a failed probe says nothing
    assert w.last_progress == 5.0
    w.probed({"kvatlas_engine_generation_tokens_total": 8.0}, now=8.0)
    assert w.last_progress == 8.0
    w.piece(now=9.0)
    assert w.last_progress == 9.0


def test_only_engines_with_waiting_work_and_past_their_deadline_are_overdue() -> None:
    quiet, idle, busy = FirstByteWatch(), FirstByteWatch(), FirstByteWatch()
    for w in (quiet, idle, busy):
        w.began(idle=True, now=0.0)
    busy.piece(now=9.0)
    late = overdue(
        [("quiet", quiet, 2), ("idle", idle, 0), ("busy", busy, 3)], 10.0, 5.0, 4.0, 600.0
    )
    assert [(o.url, o.silent_s, o.deadline_s) for o in late] == [("quiet", 10.0, 5.0)]


def test_bad_deadline_settings_are_refused_naming_the_flag() -> None:
    base = RouterConfig(engines=(StaticEngine("http://127.0.0.1:1", "a"),))
    base.validate()
    for kw, flag in (
        ({"first_byte_floor_s": 0.0}, "--first-byte-deadline-floor"),
        ({"first_byte_factor": 0.5}, "--first-byte-deadline-factor"),
        ({"first_byte_factor": float("nan")}, "--first-byte-deadline-factor"),
    ):
        with pytest.raises(ConfigError, match=flag):
            replace(base, **kw).validate()  # type: ignore[arg-type]
