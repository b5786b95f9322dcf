"""``kvatlas bench fleet --routing``'s router flags: by default the router tokenizes with
the engines' model (its added latency is then its own, not a busy engine's
``/tokenize``); ``--routing-tokenizer engine`` keeps the engines' ``/tokenize``. The
arrival rate is a load factor of the engines' measured speed unless ``--routing-rate``
fixes it; bad values are a CLI error naming the flag."""

from __future__ import annotations

import pytest

from kvatlas.cli.bench import build_parser, config_from_args, main
from kvatlas.evaluation.fleet import ENGINE_MODEL
from kvatlas.evaluation.routing import RUNS, RoutingConfig, selected_runs


def routing_tokenizer(*flags: str) -> str | None:
    cfg = config_from_args(build_parser().parse_args(["--routing", *flags])).routing
    assert cfg is not None
    return cfg.tokenizer


def test_the_router_tokenizes_with_the_engines_model_unless_told() -> None:
    assert routing_tokenizer() == ENGINE_MODEL == "smollm2-135m"
    assert routing_tokenizer("--routing-tokenizer", "engine") is None
    assert routing_tokenizer("--routing-tokenizer", "/models/smollm2") == "/models/smollm2"


def routing(*flags: str) -> RoutingConfig:
    cfg = config_from_args(build_parser().parse_args(["--routing", *flags])).routing
    assert cfg is not None
    return cfg


def test_the_rate_derives_from_the_load_unless_given() -> None:
    assert routing().rate_per_s is None and routing().load == RoutingConfig().load
    assert routing("--routing-load", "0.5").load == 0.5
    assert routing("--routing-rate", "1.5").rate_per_s == 1.5


def test_routing_runs_picks_runs_by_short_name_in_the_phases_order() -> None:
    assert routing().runs == ()
    assert [r[0] for r in selected_runs(routing().runs)] == [r[0] for r in RUNS]
    picked = routing("--routing-runs", "kv-p2p, rr-off").runs
    assert picked == ("kv-p2p", "rr-off")
    assert [r[0] for r in selected_runs(picked)] == ["round-robin, P2P off", "kv-p2p"]
    with pytest.raises(ValueError, match="unknown run fastest: the runs are rr-off, rr-on"):
        selected_runs(["fastest"])


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--routing-load", "0"], "--routing-load"),
        (["--routing-load", "-0.5"], "--routing-load"),
        (["--routing-load", "2.5"], "--routing-load"),
        (["--routing-load", "nan"], "--routing-load"),
        (["--routing-load", "lots"], "--routing-load"),
        (["--routing-rate", "0"], "--routing-rate"),
        (["--routing-rate", "inf"], "--routing-rate"),
        (["--routing-requests", "0"], "--routing-requests"),
        (["--routing-engines", "1"], "--routing-engines"),
        (["--routing-runs", "kv,fastest"], "--routing-runs"),
        (["--routing-engine-nice", "-1"], "--routing-engine-nice"),
        (["--routing-engine-nice", "20"], "--routing-engine-nice"),
    ],
)
def test_bad_routing_flags_are_a_cli_error_naming_the_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fleet", "--routing", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err
