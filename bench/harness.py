"""What the benches share: a gateway process in front of workers, started and stopped cleanly."""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import free_port  # noqa: E402


def scratch_store(work: Path, prefix: str) -> dict[str, str]:
    """REVISIT_STORE_* for a store of the bench's own: its DRAM tier in shared memory, its LMDB tier under
    ``work``. The shared-memory folders are removed when the bench exits (they outlive it otherwise)."""
    dram = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm")
    atexit.register(shutil.rmtree, dram, ignore_errors=True)
    atexit.register(shutil.rmtree, dram + "-outcomes", ignore_errors=True)
    return {"REVISIT_STORE_DRAM_DIR": dram, "REVISIT_STORE_LMDB_DIR": str(work / "lmdb")}


@dataclass(frozen=True)
class Gateway:
    url: str
    pid: int


@contextlib.contextmanager
def gateway_process(env: Mapping[str, str], log_path: Path, timeout_s: float = 60,
                    code: Path | None = None) -> Iterator[Gateway]:
    """Run `revisit gateway` with env added to this process's environment, until the block ends; yields it once
    its /health answers 200. ``code``: run the gateway of another checkout of the project (a folder holding its
    packages, say a ``git worktree`` of an older commit) in this environment, instead of this one's. A bench is one
    user's machine: the gateway serves any key (REVISIT_AUTH=open, each key its own namespace); and it measures the
    reuse paths themselves, so every plan is sent whether predicted to pay or not (REVISIT_PLAN_BY_COST=0); env may
    say otherwise."""
    port = free_port()
    args = ["gateway", "--port", str(port), "--log-level", "warning"]
    if code is None:
        command, extra = [str(Path(sys.executable).parent / "revisit"), *args], {}
    else:
        command = [sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main())", *args]
        extra = {"PYTHONPATH": str(code)}
    defaults = {"REVISIT_AUTH": "open", "REVISIT_PLAN_BY_COST": "0", "REVISIT_ADMIN_TOKEN": secrets.token_hex(16)}
    settings = {**os.environ, **defaults, **env, **extra}
    process = subprocess.Popen(command, env=settings, cwd=code, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the gateway did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        _wait_for_calibration(url, settings, log_path)
        yield Gateway(url, process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


@contextlib.contextmanager
def worker_and_gateway(model_path: Path, served_name: str, prefix: str,
                       gateway_env: Mapping[str, str]) -> Iterator[tuple[Any, Gateway]]:
    """One SGLang worker on ``model_path`` (served as ``served_name``) and a gateway in front of it, on a store of
    their own (``prefix`` names its folders), the gateway with ``gateway_env`` added; both stopped after."""
    from launcher import WorkerSpec, start_worker

    work = Path(tempfile.mkdtemp(prefix=prefix))
    store_env = scratch_store(work, prefix)
    worker = start_worker(WorkerSpec(model_path=model_path, port=free_port(), served_model_name=served_name,
                                     log_file=work / "worker.log", env=store_env))
    try:
        worker.wait_ready(900)
        env = {**store_env, "REVISIT_MODEL": served_name, "REVISIT_WORKERS": worker.url,
               "REVISIT_MODEL_DIR": str(model_path), **gateway_env}
        with gateway_process(env, work / "gateway.log") as gateway:
            yield worker, gateway
    finally:
        worker.stop()


CALIBRATION_TIMEOUT_S = 300


def _wait_for_calibration(url: str, settings: Mapping[str, str], log_path: Path) -> None:
    """Return once the gateway has measured every worker's costs (gateway/calibration.py; its probes, their PNGs
    encoded on a thread, would otherwise share the machine with the first measurements), or at once when it does
    not calibrate (its stats then have no worker costs). A calibration that failed counts as done: the gateway's log
    says why."""
    workers = [w for w in settings.get("REVISIT_WORKERS", "").split(",") if w.strip()]
    headers = {"Authorization": "Bearer " + settings["REVISIT_ADMIN_TOKEN"]}
    deadline = time.monotonic() + CALIBRATION_TIMEOUT_S
    while True:
        stats = httpx.get(url + "/admin/stats", headers=headers, timeout=30).json()
        costs = stats.get("worker_costs")
        if costs is None:  # calibration off, or the model's facts unknown to it: it measures nothing
            return
        calibrated = [u for u, w in costs["workers"].items() if w.get("calibration") is not None]
        if len(calibrated) >= len(workers):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway measured {len(calibrated)} of {len(workers)} workers' costs in "
                               f"{CALIBRATION_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)
