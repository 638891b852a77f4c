"""bench/gpu_check.py, the one GPU check: its dry run (every step on the CPU, small shapes) passes here, so that the
command a GPU machine runs is known to work up to the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"environment", "core", "partial_vision", "rows_attention", "gpu_approximate"}


def test_the_dry_run_runs_every_step_and_writes_one_json(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["dry_run"] and set(report["steps"]) == STEPS
    assert {name: row["status"] for name, row in report["steps"].items()} == dict.fromkeys(STEPS, "ok")
    steps = report["steps"]
    assert steps["environment"]["figures"]["missing"] == []
    assert steps["core"]["figures"]["passed"] >= 10 and "failed" not in steps["core"]["figures"]
    assert steps["partial_vision"]["figures"]["every_vs_full_max_abs"] < 1e-4
    assert steps["gpu_approximate"]["figures"]["sizes"][0]["approximate_full_x"] > 0
    assert all(case["batched_ms"] > 0 for case in steps["rows_attention"]["figures"]["cases"])
    table = done.stdout.splitlines()
    assert all(any(line.startswith(f"{name} ") and " ok " in line for line in table) for name in STEPS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device the check runs for real, it does not refuse")
def test_without_a_device_it_says_to_dry_run() -> None:
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "no CUDA device here; --dry-run" in done.stderr
