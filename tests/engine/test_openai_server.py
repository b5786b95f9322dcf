"""The engine's OpenAI-compatible HTTP API on loopback.

Most tests run one in-process engine on the tiny random model without a cache; one runs
``kvatlas engine`` and ``examples/send_request.py`` as real processes beside a real cache
server (the reference guide's single-machine test), and one (slow) uses SmolLM2.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.cli.engine import main as engine_main
from kvatlas.engine.config import CacheLinkConfig, EngineConfig
from kvatlas.engine.engine_app import EngineApp
from kvatlas.engine.model import LoadedModel
from kvatlas.launch.procs import free_port
from support.launch import launch, python_module

from .conftest import StartCacheServer

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def app(tiny: LoadedModel) -> Iterator[EngineApp]:
    config = EngineConfig(
        model="tiny-random", port=0, cache=None, max_model_len=MAX_MODEL_LEN, default_max_tokens=8
    )
    engine = EngineApp(config, model=tiny)
    engine.start()
    yield engine
    engine.stop()


def post(app: EngineApp, path: str, body: Any, expect: int = 200) -> dict[str, Any]:
    kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{app.url}{path}", timeout=60, **kw)
    assert r.status_code == expect, r.text
    assert r.headers["content-type"].startswith("application/json")
    return dict(r.json())


def sse(app: EngineApp, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data events of a streamed answer; asserts it ends with [DONE]."""
    events: list[str] = []
    with httpx.stream("POST", f"{app.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events.extend(line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: "))
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 12,
        "ignore_eos": True,
        **extra,
    }


# ----------------------------------------------------------------------------- answers


def test_chat_completion_shape(app: EngineApp) -> None:
    out = post(app, "/v1/chat/completions", chat("Hello there"))
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["model"] == "tiny-random"
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    usage = out["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "cached_token_stats" not in out  # only when asked for
    # greedy is deterministic; content given as text parts is the same prompt
    parts = chat(
        "", messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    )
    assert post(app, "/v1/chat/completions", parts)["choices"] == out["choices"]


def test_chat_stream_matches_the_plain_answer(app: EngineApp) -> None:
    body = chat("Tell me a story", kv_transfer_params={"cached_token_stats": True})
    plain = post(app, "/v1/chat/completions", body)
    chunks = sse(app, "/v1/chat/completions", {**body, "stream": True})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == plain["choices"][0]["message"]["content"]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    stats = last["cached_token_stats"]
    assert stats["num_prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert stats["num_prefilled_tokens"] == stats["num_prompt_tokens"]
    assert stats["ttft_ms"] > 0 and stats["fallback"] is None

    # include_usage: one more chunk with no choices and the usage (and the stats)
    chunks = sse(
        app,
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert "cached_token_stats" in chunks[-1]


def test_completions_with_text_token_ids_and_stream(app: EngineApp) -> None:
    tok = app.model.tokenizer
    text = post(app, "/v1/completions", {"prompt": "Once upon", "max_tokens": 6, "temperature": 0})
    assert text["object"] == "text_completion"
    ids = post(
        app,
        "/v1/completions",
        {"prompt": tok.encode("Once upon"), "max_tokens": 6, "temperature": 0},
    )
    assert ids["choices"][0]["text"] == text["choices"][0]["text"]
    assert ids["usage"]["prompt_tokens"] == len(tok.encode("Once upon"))
    chunks = sse(
        app,
        "/v1/completions",
        {"prompt": ["Once upon"], "max_tokens": 6, "temperature": 0, "stream": True},
    )
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == text["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}


def test_stop_strings_and_sampling(app: EngineApp) -> None:
    long = post(
        app,
        "/v1/completions",
        {"prompt": "abc", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    )
    full = long["choices"][0]["text"]
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    cut = post(
        app,
        "/v1/completions",
        {"prompt": "abc", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stop},
    )
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    streamed = sse(
        app,
        "/v1/completions",
        {"prompt": "abc", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
         "stop": [stop], "stream": True},
    )  # fmt: skip
    assert "".join(c["choices"][0]["text"] for c in streamed) == full[: full.index(stop)]
    # sampling with a seed is reproducible
    body = {"prompt": "abc", "max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 7}
    a = post(app, "/v1/completions", body)["choices"][0]["text"]
    assert post(app, "/v1/completions", body)["choices"][0]["text"] == a


def test_models_health_and_metrics(app: EngineApp) -> None:
    models = httpx.get(f"{app.url}/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "tiny-random" and card["max_model_len"] == MAX_MODEL_LEN
    assert card["root"] == app.model.name
    assert httpx.get(f"{app.url}/healthz").json() == {
        "status": "ok",
        "model": app.model.name,
        "cache": "disabled",
    }
    post(app, "/v1/chat/completions", chat("count me", model=app.model.name))
    metrics = httpx.get(f"{app.url}/metrics").text
    assert re.search(
        r'kvatlas_engine_requests_total\{code="200",endpoint="/v1/chat/completions"\} [1-9]',
        metrics,
    )
    for name in (
        "kvatlas_engine_ttft_seconds_bucket",
        "kvatlas_engine_prefilled_tokens_total",
        "kvatlas_engine_cached_tokens_total",
        "kvatlas_engine_peer_cached_tokens_total",
        "kvatlas_engine_decode_tokens_per_second_count",
    ):
        assert name in metrics
    # the model's KV storage is kept between requests, and what it holds is exported
    held = re.search(r"^kvatlas_engine_kv_arena_bytes ([0-9.e+]+)$", metrics, re.M)
    assert held is not None and float(held.group(1)) == app.core.arena.nbytes > 0


def test_tokenize_answers_the_ids_the_engine_prefills(app: EngineApp) -> None:
    body = chat("how many tokens is this?")
    answer = post(app, "/v1/chat/completions", body)
    tok = post(app, "/tokenize", body)  # a chat body is a tokenize body
    assert tok["count"] == len(tok["tokens"]) == answer["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == MAX_MODEL_LEN
    plain = post(app, "/tokenize", {"prompt": "abc"})
    assert plain["tokens"] == list(b"abc")  # the tiny model's byte tokenizer
    done = post(app, "/v1/completions", {"prompt": plain["tokens"], "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == 3
    bad = post(app, "/tokenize", {"model": "tiny-random"}, expect=400)
    assert "exactly one of messages or prompt" in bad["error"]["message"]
    post(app, "/tokenize", {"prompt": "x", "model": "other"}, expect=404)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", b"{not json", None),
        ("/v1/chat/completions", {"model": "tiny-random"}, None),  # no messages
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "n": 2}, "n"),
        ("/v1/chat/completions", chat("x", temperature=5), "temperature"),
        ("/v1/chat/completions", chat("x", top_p=0), "top_p"),
        ("/v1/chat/completions", chat("x", max_tokens=0), "max_tokens"),
        ("/v1/chat/completions", chat("x", stop=["a", "b", "c", "d", "e"]), "stop"),
        ("/v1/chat/completions", chat("x" * MAX_MODEL_LEN), "messages"),
        ("/v1/chat/completions", chat("x", max_tokens="many"), None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": [1, 2, 10_000]}, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, None),
    ],
)
def test_bad_input_is_a_400_with_a_reason(
    app: EngineApp, path: str, body: Any, param: str | None
) -> None:
    err = post(app, path, body, expect=400)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_unknown_model_is_a_404(app: EngineApp) -> None:
    err = post(app, "/v1/chat/completions", chat("x", model="gpt-9"), expect=404)["error"]
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]


def test_cli_refuses_bad_flags_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_main(["--model", "tiny-random", "--port", "70000", "--no-cache"]) == 2
    assert "--port" in capsys.readouterr().err
    assert engine_main(["--model", "tiny-random", "--cache-timeout", "0"]) == 2
    assert "--cache-timeout" in capsys.readouterr().err
    assert engine_main(["--chunk-size", "0"]) == 2
    assert "--chunk-size" in capsys.readouterr().err


# ----------------------------------------------------------------------------- processes


def test_engine_process_and_send_request_example(
    tmp_path: Path, start_cache_server: StartCacheServer
) -> None:
    """The reference guide's single-machine flow: cache server, engine, send_request x2."""
    server = start_cache_server()
    port = free_port()
    argv = python_module(
        "kvatlas.cli.engine", "--model", "tiny-random", "--port", str(port),
        "--cache-port", str(server.port), "--log-level", "INFO",
    )  # fmt: skip
    with launch(
        argv, name="engine", log=tmp_path / "engine.log", http_port=port, timeout=60
    ) as eng:
        example = [
            sys.executable, str(ROOT / "examples" / "send_request.py"),
            "--port", str(port), "--tokens", "300", "--max-tokens", "8",
        ]  # fmt: skip
        runs = [
            subprocess.run(example, check=False, capture_output=True, text=True, timeout=60)
            for _ in "ab"
        ]
        for run in runs:
            assert run.returncode == 0, run.stderr
        cold = int(re.findall(r"num_cached_tokens: (\d+)", runs[0].stdout)[0])
        warm = int(re.findall(r"num_cached_tokens: (\d+)", runs[1].stdout)[0])
        assert cold == 0 and warm >= 256, runs[1].stdout
        answers = [r.stdout.split("answer:", 1)[1] for r in runs]
        assert answers[0] == answers[1]
        assert server.status()["l1"]["chunks"] >= 4
        assert eng.stop(grace_s=30) == 0, eng.text()
    text = eng.text()
    assert "loading model tiny-random" in text and "registered model" in text


@pytest.mark.slow
def test_smollm2_answers_the_same_with_its_prefix_from_the_cache(
    smol: LoadedModel, start_cache_server: StartCacheServer
) -> None:
    server = start_cache_server()
    config = EngineConfig(
        model="smollm2-135m", port=0, cache=CacheLinkConfig(port=server.port, timeout_s=2.0)
    )
    doc = "\n".join(f"Item {i}: the cache keeps chunk {i} for the fleet." for i in range(45))
    body = {
        "messages": [{"role": "user", "content": doc + "\nWhat does the cache keep?"}],
        "max_tokens": 12,
        "temperature": 0,
        "kv_transfer_params": {"cached_token_stats": True},
    }
    app = EngineApp(config, model=smol)
    app.start()
    try:
        first = post(app, "/v1/chat/completions", body)
        second = post(app, "/v1/chat/completions", body)
    finally:
        app.stop()
    s1, s2 = first["cached_token_stats"], second["cached_token_stats"]
    assert s1["num_prompt_tokens"] > 512 and s1["num_cached_tokens"] == 0
    n_full = s1["num_prompt_tokens"] // 256
    assert s2["num_cached_tokens"] == n_full * 256 and s2["fallback"] is None
    assert s2["num_prefilled_tokens"] < s1["num_prefilled_tokens"]
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert first["choices"][0]["message"]["content"].strip()
