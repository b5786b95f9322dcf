"""The router against the official OpenAI Python client, not our reading of the API.

Applications reach a front door like ``kvatlas router`` through this client; these tests
hand it the router's base URL and use it as an application would: a chat completion, a
streamed chat completion (the client parses the SSE stream itself), a streamed
completion, the model list, and its own API key and request id passing through.
"""

from __future__ import annotations

import openai
from openai.types.chat import ChatCompletionMessageParam

from kvatlas.router.config import StaticEngine
from support.tap import HttpTap
from support.wait import wait_until

from .conftest import Fleet, StartRouter
from .test_router import available


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="client-key", max_retries=0, timeout=60)


def test_the_openai_client_chats_streams_and_lists_models_through_the_router(
    fleet: Fleet, start_router: StartRouter
) -> None:
    engine = fleet.engines[0]
    with HttpTap(engine.port) as tap:
        router = start_router(engines=(StaticEngine(tap.url, "node-a"),), policy="round-robin")
        wait_until(lambda: available(router), what="the tapped engine")
        oa = client(router.url)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]
        done = oa.chat.completions.create(
            model="tiny-random",
            messages=messages,
            max_tokens=5,
            temperature=0,
            extra_headers={"X-Request-Id": "req-oa-1"},
            extra_body={"ignore_eos": True},
        )
        assert done.choices[0].message.role == "assistant"
        assert done.usage is not None and done.usage.completion_tokens == 5
        streamed = oa.chat.completions.create(
            model="tiny-random",
            messages=messages,
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
        # the same greedy answer, whole, in pieces
        assert "".join(pieces) == done.choices[0].message.content
        text = "".join(
            c.choices[0].text
            for c in oa.completions.create(
                model="tiny-random",
                prompt="Once upon a time",
                max_tokens=4,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert text
        assert [m.id for m in oa.models.list()] == ["tiny-random"]
        chats = [q for q in tap.requests if q.target == "/v1/chat/completions"]
        assert len(chats) == 2
        assert chats[0].headers["authorization"] == "Bearer client-key"
        assert chats[0].headers["x-request-id"] == "req-oa-1"
