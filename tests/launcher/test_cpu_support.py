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


def test_a_tensor_parallel_cpu_worker_gets_the_platform_without_pynccl_and_its_own_cores() -> None:
    from launcher.cpu_support import PLATFORM_NAME, PLATFORM_SITE, thread_binds
    from launcher.launch import tensor_parallel_size

    spec = WorkerSpec(model_path=Path("/nonexistent"), device="cpu", extra_args=("--tp-size", "2"), cpu_threads=4)
    _, env = build_launch(spec)
    assert env["SGLANG_PLATFORM"] == PLATFORM_NAME and env["PYTHONPATH"].startswith(str(PLATFORM_SITE))
    assert env["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1 and env["OMP_NUM_THREADS"] in ("1", "2")
    # SGLang discovers the platform through its entry point, and it activates in CPU workers only
    probe = subprocess.run([sys.executable, "-c", (
        "import importlib.metadata as m, os;"
        "ep = [e for e in m.entry_points(group='sglang.srt.platforms') if e.name == 'revisit_cpu'][0];"
        "print(ep.load()());"
        "os.environ['SGLANG_USE_CPU_ENGINE'] = '0'; print(ep.load()())")],
        env={**os.environ, "PYTHONPATH": f"{PLATFORM_SITE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
             "SGLANG_USE_CPU_ENGINE": "1"}, capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["revisit_cpu_platform.RevisitCpuPlatform", "None"], probe.stderr
    # a one-rank worker, and a GPU worker, get none of it
    for plain in (WorkerSpec(model_path=Path("/nonexistent"), device="cpu"),
                  WorkerSpec(model_path=Path("/nonexistent"), device="cuda", extra_args=("--tp-size", "2"))):
        _, env = build_launch(plain)
        assert "SGLANG_PLATFORM" not in env and str(PLATFORM_SITE) not in env["PYTHONPATH"]
    assert tensor_parallel_size(["--tp-size=4"]) == 4 and tensor_parallel_size(["--log-requests"]) == 1
    assert thread_binds([0, 1, 2, 3], 2) == "0,1|2,3" and thread_binds([0], 2) == "0|0"
    with pytest.raises(ValueError):
        thread_binds([], 2)
