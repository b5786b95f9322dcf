"""vLLM's own code for these tests: its wheel installs without dependencies beside CPU
torch (scripts/bootstrap.sh installs it, ``--no-deps``); where it is absent the tests
that need it skip, saying so.

vLLM's import chain (torch.jit, pydantic) warns about its own deprecated uses; the suite
turns warnings into errors, so the modules the tests use are imported here once with
those warnings silenced, and the tests find them already imported. The import also sets
a few torch-compile environment variables and warning filters of its own; both are put
back, so that the rest of the session (and the processes it starts) does not inherit
them."""

from __future__ import annotations

import contextlib
import os
import warnings

_env = dict(os.environ)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with contextlib.suppress(ImportError):
        import vllm.distributed.kv_events
        import vllm.lora.request
        import vllm.sampling_params
        import vllm.utils.hashing
        import vllm.v1.core.kv_cache_utils
        import vllm.v1.request  # noqa: F401

for _name in set(os.environ) - set(_env):
    del os.environ[_name]
os.environ.update(_env)
