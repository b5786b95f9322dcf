"""Send one long chat request to a kvatlas engine and print where its prompt KV came from.

The prompt is a deterministic numbered document long enough to span several 256-token
chunks, so a second run (on the same engine, or on another node of the fleet) can load
its prefix from the cache instead of prefilling it. Standard library only:

    python examples/send_request.py --port 8000              # cold: ~0 cached tokens
    python examples/send_request.py --port 8000              # warm: cached tokens > 0
    python examples/send_request.py --host 10.0.0.3 --port 8000   # another node (P2P)

``num_cached_tokens`` is what LMCache's example prints as ``num_lmcache_cached_tokens``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

CHARS_PER_TOKEN = 4
"""A rough English average, to size the document without a tokenizer."""


def build_document(tokens: int) -> str:
    """A numbered document of about ``tokens`` tokens; the same text on every run."""
    lines: list[str] = []
    size = 0
    i = 0
    while size < tokens * CHARS_PER_TOKEN:
        i += 1
        line = (
            f"Section {i}: the fleet keeps chunk {i} of this document in memory so that"
            f" node {i % 7} never prefills it twice."
        )
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def build_body(tokens: int, max_tokens: int, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": "You answer in one short sentence."},
            {
                "role": "user",
                "content": build_document(tokens) + "\n\nWhat is this document about?",
            },
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "kv_transfer_params": {"cached_token_stats": True},
    }
    if model:
        body["model"] = model
    return body


def send(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tokens", type=int, default=1500, help="approximate prompt length")
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens")
    ap.add_argument("--model", default=None, help="model name (default: the engine's)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds")
    args = ap.parse_args(argv)

    url = f"http://{args.host}:{args.port}/v1/chat/completions"
    t0 = time.perf_counter()
    try:
        answer = send(url, build_body(args.tokens, args.max_tokens, args.model), args.timeout)
    except urllib.error.HTTPError as exc:
        print(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0

    stats = answer.get("cached_token_stats") or {}
    print("cached_token_stats:")
    for key in (
        "num_prompt_tokens",
        "num_cached_tokens",
        "num_peer_cached_tokens",
        "num_prefilled_tokens",
        "ttft_ms",
        "load_ms",
        "fallback",
    ):
        print(f"  {key}: {stats.get(key)}")
    print(f"request took {elapsed * 1000:.0f} ms")
    print("answer:", answer["choices"][0]["message"]["content"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
