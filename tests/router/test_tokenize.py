"""``kvatlas.tokenize``: the router's tokenizer without transformers or torch, and the
same tokenizer, template and ids as the engine's, which loads them through transformers
(``kvatlas.engine.model.load_tokenizer``, the reference here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvatlas.engine.model import HFTokenizer
from kvatlas.engine.model import load_tokenizer as engine_tokenizer
from kvatlas.tokenize.fast_encoder import self_test_texts
from kvatlas.tokenize.loading import (
    ByteTokenizer,
    HubTokenizer,
    TokenizerLoadError,
    load_tokenizer,
)

CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You answer in one line.\n"},
        {"role": "user", "content": "Naïve café? 😀 <|im_end|> twice:\tfour\n\nfour"},
        {"role": "assistant", "content": "4, 4 — done."},
        {"role": "user", "content": ""},
    ],
]
EXTRA = ["<|im_start|>user\nhi<|im_end|>\n", " <|endoftext|>x", "a<|im_start|>b", ""]


def _same(hub: HubTokenizer, hf: HFTokenizer) -> None:
    texts = [*self_test_texts(hf.inner.backend_tokenizer), *EXTRA]
    assert [hub.encode(t) for t in texts] == [hf.encode(t) for t in texts]
    for chat in CHATS:
        for gen in (True, False):
            rendered = hf.inner.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert hub.render(chat, gen) == rendered
            assert hub.apply_chat_template(chat, gen) == hf.apply_chat_template(chat, gen)
    assert hub.eos_token_ids == hf.eos_token_ids
    ours = json.loads(hub.backend.to_str())
    theirs = json.loads(hf.inner.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "added_tokens", "model"):
        assert ours[part] == theirs[part], part


@pytest.fixture(scope="module")
def smol() -> tuple[HubTokenizer, HFTokenizer]:
    hub, hf = load_tokenizer("smollm2-135m"), engine_tokenizer("smollm2-135m")
    assert isinstance(hub, HubTokenizer) and isinstance(hf, HFTokenizer)
    return hub, hf


def test_the_gguf_tokenizer_is_the_one_transformers_builds(
    smol: tuple[HubTokenizer, HFTokenizer],
) -> None:
    _same(*smol)


def test_a_hugging_face_folder_loads_as_the_engine_loads_it(
    smol: tuple[HubTokenizer, HFTokenizer], tmp_path: Path
) -> None:
    smol[1].inner.save_pretrained(tmp_path)
    hub = load_tokenizer(str(tmp_path))
    assert isinstance(hub, HubTokenizer)
    _same(hub, HFTokenizer(AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)))


def test_tiny_random_is_bytes_and_unknown_models_are_named() -> None:
    assert isinstance(load_tokenizer("tiny-random"), ByteTokenizer)
    with pytest.raises(TokenizerLoadError, match="unknown model"):
        load_tokenizer("no-such-model")


def test_the_router_builds_its_tokenizer_without_torch(tmp_path: Path) -> None:
    """``kvatlas router --tokenizer``'s whole path in a fresh interpreter: its CLI
    imported, the tokenizer loaded from the flag and a chat encoded; neither torch nor
    transformers is imported."""
    script = textwrap.dedent(
        """
        import sys
        from kvatlas.cli.router import build_parser, tokenizer_from_args
        for model in ("smollm2-135m", "tiny-random"):
            args = build_parser().parse_args(["--tokenizer", model])
            tok = tokenizer_from_args(args)
            assert tok is not None and tok.blob(b'{"messages":[{"role":"user","content":"hi"}]}')
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
