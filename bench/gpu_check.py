"""The one GPU check: what of the engine extension can run on a GPU without SGLang, run there, in one command.

On a machine with CUDA, torch and transformers (no SGLang, no project install), from the repository root:

    python3 bench/gpu_check.py [--json FILE] [--budget-s 480]
    python3 bench/gpu_check.py --dry-run          # the same steps on the CPU, small shapes (make test runs it)

Steps, in this order, each in its own process with what is left of the budget (8 minutes by default):

    environment      Python, torch, transformers, the device, and the modules the later steps import
    core             tests/engine_ext/test_core.py on the device (attention for the computed rows over a KV pool,
                     row depths, K/V row groups read from a real shared-memory store and moved on the device, the
                     batched rows attention against the per-sequence loop); pytest without the suite's conftest
    partial_vision   the partial vision pass (offline.reference.vision) on a random-weight Qwen3-VL-shaped tower
                     on the device: over every token it is the full pass; over a box of tokens it equals the same
                     pass on the CPU with the same weights
    rows_attention   bench/rows_attention.py: the batched rows attention against the loop, per batch size
    gpu_approximate  bench/gpu_approximate.py at 4K and 8K image tokens: an approximate hit against a miss

Writes one JSON (``--json``, default ``$OUT/gpu_check.json`` where ``$OUT`` is set, else ``gpu_check.json``) and
prints one table. Exits 1 when a step failed, 0 otherwise (a step skipped for a missing module says which).

What the GPU machine lacks: the project's store and settings import ``blake3`` and ``lmdb``; carry their wheels
(``make gpu-wheels`` puts them in ``.whl/``) and start the command with
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site;``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT = "GPU-CHECK-RESULT "  # a step's last line: this prefix, then its figures as JSON
NEEDED = ("torch", "transformers", "numpy", "pytest", "xxhash", "blake3", "lmdb")


# --- the steps, each run as ``gpu_check.py --step NAME`` in a process of its own ---


def step_environment(device: str, dry_run: bool) -> dict[str, Any]:
    import torch
    import transformers

    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    figures: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                               "transformers": transformers.__version__, "missing": missing}
    if device == "cuda":
        figures["device"] = torch.cuda.get_device_name(0)
        figures["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return figures


def step_core(device: str, dry_run: bool) -> dict[str, Any]:
    _require("pytest", "xxhash", "blake3", "lmdb")
    # --noconftest: the suite's conftest starts gateways and workers (FastAPI, SGLang); test_core needs neither
    command = [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-q", "-rfE",
               str(ROOT / "tests" / "engine_ext" / "test_core.py"), "-k", device]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    tail = (done.stdout + done.stderr).strip().splitlines()
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", tail[-1])} \
        if tail else {}
    if done.returncode != 0 or not counts.get("passed"):
        raise StepFailed("\n".join(tail[-30:]))
    return counts


def step_partial_vision(device: str, dry_run: bool) -> dict[str, Any]:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    _require("blake3")
    from bench.gpu_approximate import config
    from offline.reference.model import EncoderOutput, ReferenceModel
    from offline.reference.vision import encode_partial

    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration._from_config(config(tiny=True), dtype=torch.float32).eval()
    side = 8 if dry_run else 32  # tokens per side (16 px patches, 2 x 2 merge)
    pixel_values = torch.randn(side * side * 4, 3 * 2 * 16 * 16)
    grid = torch.tensor([[1, side * 2, side * 2]])
    box = torch.tensor([r * side + c for r in range(side // 4, side // 2) for c in range(side // 4, side // 2)])

    torch.backends.cudnn.allow_tf32 = False  # the patch embedding is a convolution: full float32 on both devices
    torch.backends.cuda.matmul.allow_tf32 = False

    def run(on: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        moved = model.to(on)
        reference = ReferenceModel(moved, processor=None)
        with torch.inference_mode():
            out = moved.model.get_image_features(pixel_values.to(on), grid.to(on), return_dict=True)
            deepstack = getattr(out, "deepstack_features", None) or []
            full = EncoderOutput(out.pooler_output[0], tuple(layer[0] for layer in deepstack)).flat()
            every = encode_partial(reference, (pixel_values.to(on), grid), torch.arange(side * side)).flat()
            some = encode_partial(reference, (pixel_values.to(on), grid), box).flat()
        return full.float().cpu(), every.float().cpu(), some.float().cpu()

    full, every, some = run(device)
    _, _, some_cpu = run("cpu")
    width = every.shape[-1]
    every_vs_full = float((every - full).abs().max())
    some_vs_cpu = float((some - some_cpu).abs().max())
    figures = {"tokens": side * side, "box_tokens": len(box), "width": width, "every_vs_full_max_abs": every_vs_full,
               "box_vs_cpu_max_abs": some_vs_cpu}
    if every_vs_full > 1e-3 or some_vs_cpu > 1e-3:
        raise StepFailed(f"the partial pass differs: {figures}")
    return figures


def step_rows_attention(device: str, dry_run: bool) -> dict[str, Any]:
    rows = _bench_lines(["bench/rows_attention.py", "--device", device, *(["--tiny", "--threads", "1"] if dry_run
                                                                         else [])])
    return {"cases": rows}


def step_gpu_approximate(device: str, dry_run: bool) -> dict[str, Any]:
    sizes = ["--tiny", "--tokens", "256", "--reps", "1"] if dry_run else ["--tokens", "4096", "8192"]
    return {"sizes": _bench_lines(["bench/gpu_approximate.py", *sizes])}


STEPS = {"environment": step_environment, "core": step_core, "partial_vision": step_partial_vision,
         "rows_attention": step_rows_attention, "gpu_approximate": step_gpu_approximate}


class StepFailed(Exception):
    pass


class StepSkipped(Exception):
    pass


def _require(*modules: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise StepSkipped(f"missing module(s): {', '.join(missing)} (see the module docstring)")


def _bench_lines(argv: list[str]) -> list[dict[str, Any]]:
    """Run a bench script; its JSON lines (one per case), or StepFailed with its output's end."""
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise StepFailed("\n".join((done.stdout + done.stderr).strip().splitlines()[-30:]))
    return lines


def _run_step(name: str, device: str, dry_run: bool) -> int:
    """In the step's own process: its figures, as one RESULT line."""
    began = time.monotonic()
    row: dict[str, Any]
    try:
        row = {"status": "ok", "figures": STEPS[name](device, dry_run)}
    except StepSkipped as exc:
        row = {"status": "skipped", "detail": str(exc)}
    except Exception as exc:  # the step's failure, reported in the table: the next steps still run
        row = {"status": "failed", "detail": f"{type(exc).__name__}: {exc}"[-4000:]}
    row["seconds"] = round(time.monotonic() - began, 1)
    print(RESULT + json.dumps(row), flush=True)
    return 0


# --- the parent: every step, one JSON, one table ---


def check(device: str, dry_run: bool, budget_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + budget_s
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               PYTHONUNBUFFERED="1")
    steps: dict[str, Any] = {}
    for name in STEPS:
        left = deadline - time.monotonic()
        if left < 5:
            steps[name] = {"status": "failed", "detail": "out of time: the budget ran out before this step",
                           "seconds": 0.0}
            continue
        print(f"[gpu-check] {name} ({left:.0f} s left)", file=sys.stderr, flush=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--step", name, "--device", device,
                   *(["--dry-run"] if dry_run else [])]
        began = time.monotonic()
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            steps[name] = {"status": "failed", "detail": f"timed out after {left:.0f} s",
                           "seconds": round(time.monotonic() - began, 1)}
            continue
        results = [line[len(RESULT):] for line in done.stdout.splitlines() if line.startswith(RESULT)]
        steps[name] = json.loads(results[-1]) if results else {
            "status": "failed", "seconds": round(time.monotonic() - began, 1),
            "detail": "\n".join((done.stdout + done.stderr).strip().splitlines()[-30:])}
    return {"device": device, "dry_run": dry_run, "budget_s": budget_s, "steps": steps}


def summary(name: str, row: dict[str, Any]) -> str:
    """A step's key figures in one cell."""
    figures = row.get("figures") or {}
    if row["status"] != "ok":
        return row.get("detail", "").splitlines()[-1][:100] if row.get("detail") else ""
    if name == "environment":
        missing = ",".join(figures["missing"]) or "none"
        return (f"{figures.get('device', 'cpu')}, py {figures['python']}, torch {figures['torch']}, "
                f"missing: {missing}")
    if name == "core":
        return ", ".join(f"{n} {kind}" for kind, n in figures.items())
    if name == "partial_vision":
        return (f"{figures['tokens']} tokens: every vs full {figures['every_vs_full_max_abs']:.1e}, "
                f"box of {figures['box_tokens']} vs CPU {figures['box_vs_cpu_max_abs']:.1e}")
    if name == "rows_attention":
        return "; ".join(f"{c['sequences']} seqs: loop/batched {c['loop_over_batched']:.2f}x"
                         for c in figures["cases"])
    if name == "gpu_approximate":
        return "; ".join(f"{s['image_tokens']} tok: approx/full {s['approximate_full_x']:.2f}x, "
                         f"approx/partial {s['approximate_partial_x']:.2f}x" for s in figures["sizes"])
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, small shapes")
    parser.add_argument("--json", default=None, help="where the results go (default: $OUT/ or ./gpu_check.json)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="for all steps together")
    parser.add_argument("--step", choices=sorted(STEPS), help=argparse.SUPPRESS)
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.step:
        return _run_step(args.step, args.device, args.dry_run)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device here; --dry-run runs the steps on the CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    report = check(device, args.dry_run, args.budget_s)
    out = Path(args.json) if args.json else Path(os.environ.get("OUT") or ".") / "gpu_check.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'step':<16} {'status':<8} {'s':>6}  figures")
    for name, row in report["steps"].items():
        print(f"{name:<16} {row['status']:<8} {row['seconds']:>6.1f}  {summary(name, row)}")
    print(f"\nwritten: {out}")
    return 1 if any(row["status"] == "failed" for row in report["steps"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
