"""``python -m launcher.worker``: the foreground worker command (checked without starting it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bundled import DEFAULT_ARCH
from bundled.config import ENV_CACHE_DIR


def _worker(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {ENV_CACHE_DIR: str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "launcher.worker", *args], env=env, capture_output=True, text=True
    )


def test_print_command_for_the_bundled_model(model_cache: Path, tiny_models: dict[str, Path]) -> None:
    result = _worker(
        "--model", "bundled", "--port", "31999", "--print-command", "--", "--log-requests", cache=model_cache
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "SGLANG_USE_CPU_ENGINE=1" in lines
    assert "SGLANG_EXTERNAL_MODEL_PACKAGE=engine_ext.models" in lines
    command = lines[-1]
    assert f"--model-path {tiny_models[DEFAULT_ARCH]}" in command
    assert "--port 31999" in command and command.endswith("--log-requests")


def test_a_directory_without_a_model_is_refused(tmp_path: Path) -> None:
    result = _worker("--model", str(tmp_path), "--print-command", cache=tmp_path)
    assert result.returncode == 2
    assert "not a model directory" in result.stderr
