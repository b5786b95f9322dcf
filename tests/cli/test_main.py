"""The console script: commands load only their own modules, and only the reference
engine's process imports torch (and a router's given ``--tokenizer``, on use)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvatlas.cli.main import COMMANDS, main

TORCH_FREE = sorted(set(COMMANDS) - {"engine"})

PROBE = """
import importlib, sys
import kvatlas.cli.main
assert not [m for m in sys.modules if m.startswith("kvatlas.cli.") and m != "kvatlas.cli.main"]
importlib.import_module(sys.argv[1])
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def _modules_loaded_by(module: str) -> str:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, module],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.stdout.strip()


@pytest.mark.parametrize("command", TORCH_FREE)
def test_only_the_engine_imports_torch(command: str) -> None:
    assert _modules_loaded_by(COMMANDS[command]) == "[]"


def test_the_engine_does_import_torch() -> None:
    # The probe can see torch: the assertion above is not vacuous. (The engine command
    # imports its composition root, and torch, when it starts: its --help needs neither.)
    assert _modules_loaded_by("kvatlas.engine.engine_app") == "['torch', 'transformers']"


def test_help_and_unknown_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "coordinator" in capsys.readouterr().out
    assert main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["coordinator", "--help"])
    assert exc.value.code == 0


@pytest.mark.parametrize("command", ["server", "coordinator", "router", "engine"])
def test_a_bad_log_level_is_refused_naming_the_flag(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The server passed the level to logging as it came, so a bad one was a traceback.
    assert main([command, "--log-level", "chatty"]) == 2
    assert "--log-level" in capsys.readouterr().err
