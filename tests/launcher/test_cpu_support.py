"""The sgl_kernel stand-in: importable only through the CPU launcher's PYTHONPATH."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import WorkerSpec, build_launch
from launcher.cpu_support import STUB_SITE, has_real_sgl_kernel, kernel_stand_in_path

pytestmark = pytest.mark.skipif(has_real_sgl_kernel(), reason="a real sgl_kernel is installed")

_PROBE = """
import json, torch, sgl_kernel
result = {"stand_in": getattr(sgl_kernel, "STAND_IN", False), "file": sgl_kernel.__file__}
try:
    sgl_kernel.merge_state_v2(None)
except NotImplementedError as exc:
    result["call"] = str(exc)
try:
    torch.ops.sgl_kernel.rmsnorm_cpu(None)
except NotImplementedError as exc:
    result["op_call"] = str(exc)
try:
    import sgl_kernel.scalar_type
except ImportError:
    result["submodule"] = "ImportError"
ops = torch.ops.sgl_kernel
result["present"] = [n for n in sgl_kernel.IMPORT_TIME_OPS if hasattr(ops, n)]
result["absent"] = [n for n in ("convert_weight_packed", "fused_qk_norm_cpu", "fused_qk_norm_rope_cpu")
                    if not hasattr(ops, n)]
print(json.dumps(result))
"""


def _run_probe(env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_stand_in_is_not_importable_by_default() -> None:
    assert importlib.util.find_spec("sgl_kernel") is None
    assert str(STUB_SITE) not in sys.path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", "import sgl_kernel"], env=env, capture_output=True, text=True
    )
    assert result.returncode != 0 and "No module named 'sgl_kernel'" in result.stderr


def test_stand_in_in_a_cpu_worker_environment() -> None:
    assert kernel_stand_in_path() == STUB_SITE
    _, env = build_launch(WorkerSpec(model_path=Path("/nonexistent"), device="cpu"))
    probe = _run_probe(env)
    assert probe["stand_in"] is True
    assert Path(probe["file"]).is_relative_to(STUB_SITE)
    assert "CPU stand-in" in probe["call"] and "CPU stand-in" in probe["op_call"]
    assert probe["submodule"] == "ImportError"  # SGLang falls back to Python code on ImportError
    assert len(probe["present"]) == 11
    assert len(probe["absent"]) == 3  # their absence keeps SGLang on portable paths


def test_gpu_workers_never_get_the_stand_in() -> None:
    _, env = build_launch(WorkerSpec(model_path=Path("/nonexistent"), device="cuda"))
    assert str(STUB_SITE) not in env["PYTHONPATH"]
    assert "SGLANG_USE_CPU_ENGINE" not in env


def test_stand_in_on_the_path_is_not_mistaken_for_the_real_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(STUB_SITE))
    assert importlib.util.find_spec("sgl_kernel") is not None
    assert not has_real_sgl_kernel()
    assert kernel_stand_in_path() == STUB_SITE
