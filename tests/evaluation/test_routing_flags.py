"""``kvatlas bench fleet --routing``'s router flags: by default the router tokenizes with
the engines' model (its added latency is then its own, not a busy engine's
``/tokenize``); ``--routing-tokenizer engine`` keeps the engines' ``/tokenize``."""

from __future__ import annotations

from kvatlas.cli.bench import build_parser, config_from_args
from kvatlas.evaluation.fleet import ENGINE_MODEL


def routing_tokenizer(*flags: str) -> str | None:
    cfg = config_from_args(build_parser().parse_args(["--routing", *flags])).routing
    assert cfg is not None
    return cfg.tokenizer


def test_the_router_tokenizes_with_the_engines_model_unless_told() -> None:
    assert routing_tokenizer() == ENGINE_MODEL == "smollm2-135m"
    assert routing_tokenizer("--routing-tokenizer", "engine") is None
    assert routing_tokenizer("--routing-tokenizer", "/models/smollm2") == "/models/smollm2"
