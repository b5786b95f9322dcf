"""`Driver`: LMCache 0.5.6's unmodified vLLM adapters (``mp_driver.py``, run by
.venv-lmcache's Python) as a child process speaking JSON lines over pipes, stopped by its
own pid. Shared by the MP protocol tests and the deploy doc's test, where it stands in
for ``vllm serve``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from support.launch import Proc, launch

DRIVER = Path(__file__).with_name("mp_driver.py")
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
"""LMCache's environment in every test: no usage reports, no banner."""


class Driver:
    """The adapters against the server at ``url`` in transfer ``mode``; ``ready`` is the
    driver's first line (it names the chunk size the server answered)."""

    def __init__(self, venv: Path, url: str, mode: str, log: Path, name: str = "") -> None:
        env = {**os.environ, **QUIET}
        env.pop("PYTHONPATH", None)  # kvatlas' sources stay out of LMCache's interpreter
        self.proc: Proc = launch(
            [str(venv / "bin" / "python"), str(DRIVER), url, mode],
            name=name or f"driver-{mode}",
            log=log,
            env=env,
            wait=False,
            pipes=True,
        )
        self.ready = self._read()
        assert self.ready.get("ready"), self.ready

    def call(self, op: str, tokens: list[int], rid: str, **extra: Any) -> dict[str, Any]:
        stdin = self.proc.popen.stdin
        assert stdin is not None
        stdin.write(json.dumps({"op": op, "tokens": tokens, "rid": rid, **extra}) + "\n")
        stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        stdout = self.proc.popen.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.name} exited:\n{self.proc.text()[-4000:]}")
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        stdin = self.proc.popen.stdin
        if self.proc.popen.poll() is None and stdin is not None:
            try:
                stdin.write('{"op": "quit"}\n')
                stdin.close()
                self.proc.popen.wait(30)
            except (BrokenPipeError, OSError):
                pass
        self.proc.stop(signal.SIGTERM)
