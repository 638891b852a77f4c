"""Worker launch plans, readiness polling and process-group shutdown, with real processes."""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from launcher import (
    CPU_MAX_TOTAL_TOKENS,
    SGLANG_VERSION,
    WorkerProcess,
    WorkerSpec,
    build_launch,
    check_sglang_version,
    live_group_members,
    resolve_dtype,
    verify_sglang_version,
)
from launcher.errors import SGLangVersionError, WorkerExitedError, WorkerTimeoutError
from launcher.readiness import wait_ready, wait_ready_async
from plan.checkpoint import image_max_pixels
from plan.checkpoint import weights_dtype as checkpoint_dtype
from tests.conftest import free_port
from tests.http_server import serve_handler


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_cpu_launch_plan(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["qwen2_5_vl"]
    spec = WorkerSpec(
        model_path=path, port=31234, served_model_name="tiny", cpu_threads=3, extra_args=("--x", "1")
    )
    argv, env = build_launch(spec, base_env={"PATH": "/usr/bin", "PYTHONPATH": "/keep"})
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert _flag(argv, "--model-path") == str(path)
    assert _flag(argv, "--port") == "31234"
    assert _flag(argv, "--served-model-name") == "tiny"
    assert _flag(argv, "--device") == "cpu"
    assert _flag(argv, "--attention-backend") == "torch_native"
    assert _flag(argv, "--max-total-tokens") == str(CPU_MAX_TOTAL_TOKENS)
    assert _flag(argv, "--dtype") == "float32"  # the checkpoint's, not SGLang's float16 "auto"
    assert "--sleep-on-idle" in argv  # an idle CPU scheduler would otherwise spin a core
    assert int(_flag(argv, "--watchdog-timeout")) >= 1800  # long CPU prefills must not trip SGLang's watchdog
    assert argv[-2:] == ["--x", "1"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "engine_ext.models"
    assert env["SGLANG_IMAGE_MAX_PIXELS"] == str(1024 * 28 * 28)
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "/keep" in env["PYTHONPATH"].split(os.pathsep)
    assert env["PATH"] == "/usr/bin"


def test_gpu_launch_plan_keeps_sglang_defaults(tiny_models: dict[str, Path]) -> None:
    spec = WorkerSpec(model_path=tiny_models["qwen3_vl"], device="cuda", dtype="bfloat16", env={"EXTRA": "1"})
    argv, env = build_launch(spec, base_env={"SGLANG_USE_CPU_ENGINE": "1"})
    assert _flag(argv, "--device") == "cuda"
    assert _flag(argv, "--dtype") == "bfloat16"
    assert "--attention-backend" not in argv and "--max-total-tokens" not in argv
    assert "--sleep-on-idle" not in argv and "--watchdog-timeout" not in argv
    assert "SGLANG_USE_CPU_ENGINE" not in env
    assert env["SGLANG_IMAGE_MAX_PIXELS"] == str(1024 * 32 * 32)
    assert env["EXTRA"] == "1"


def test_checkpoint_metadata_readers(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    assert checkpoint_dtype(tiny_models["qwen3_vl"]) == "float32"
    assert checkpoint_dtype(tmp_path) is None
    assert image_max_pixels(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text('{"max_pixels": 12845056}')
    assert image_max_pixels(tmp_path) == 12845056
    assert resolve_dtype(WorkerSpec(model_path=tmp_path)) == "auto"


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="device"):
        WorkerSpec(model_path=Path("."), device="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        WorkerSpec(model_path=Path("."), port=0)
    assert WorkerSpec(model_path=Path("."), host="0.0.0.0", port=8).url == "http://127.0.0.1:8"


def test_sglang_version_is_pinned() -> None:
    assert check_sglang_version() == SGLANG_VERSION == "0.5.23"
    with pytest.raises(SGLangVersionError, match="needs sglang==0.5.23, found 0.5.22"):
        verify_sglang_version("0.5.22")
    with pytest.raises(SGLangVersionError, match="found no sglang"):
        verify_sglang_version(None)


def _worker_running(script: str, tmp_path: Path) -> WorkerProcess:
    """A real process group led by ``python -c script``, wrapped as a worker."""
    log_file = tmp_path / "worker.log"
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return WorkerProcess(WorkerSpec(model_path=tmp_path, port=free_port()), process, log_file)


def test_wait_ready_fails_fast_with_the_log_tail_when_the_worker_dies(tmp_path: Path) -> None:
    script = "print('loading weights'); print('CUDA out of memory', flush=True); raise SystemExit(3)"
    worker = _worker_running(script, tmp_path)
    started = time.monotonic()
    with pytest.raises(WorkerExitedError, match="exited with code 3") as failure:
        worker.wait_ready(timeout=60)
    assert time.monotonic() - started < 10
    assert "CUDA out of memory" in failure.value.log_tail
    worker.stop()


def test_wait_ready_times_out_with_progress(tmp_path: Path) -> None:
    worker = _worker_running("import time; print('still starting', flush=True); time.sleep(60)", tmp_path)
    lines: list[str] = []
    try:
        with pytest.raises(WorkerTimeoutError, match="not ready after 2 s") as failure:
            wait_ready(worker.url, timeout=2.0, on_progress=lines.append, worker=worker, interval=0.2)
        assert "still starting" in failure.value.log_tail
    finally:
        worker.stop(grace=5)


def test_stop_kills_the_whole_group_even_when_sigterm_is_ignored(tmp_path: Path) -> None:
    script = """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", stubborn])
        print(child.pid, flush=True)
        time.sleep(600)
    """
    worker = _worker_running(script, tmp_path)
    deadline = time.monotonic() + 30
    while not worker.log_file.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    child_pid = int(worker.log_file.read_text().split()[0])
    assert child_pid in worker.live_processes()
    started = time.monotonic()
    code = worker.stop(grace=1.0)
    assert code == -signal.SIGKILL
    assert time.monotonic() - started < 10
    assert worker.live_processes() == []
    assert child_pid not in live_group_members(worker.pid)
    assert worker.stop() == code  # stopping twice is harmless


class _HealthAfter(BaseHTTPRequestHandler):
    """Answers /health with 503 for the first ``ready_after`` requests, then 200."""

    ready_after = 3
    calls = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        type(self).calls += 1
        self.send_response(200 if self.path == "/health" and type(self).calls > self.ready_after else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[str]:
    with serve_handler(type("Handler", (_HealthAfter,), {"calls": 0})) as url:
        yield url


def test_wait_ready_sync_polls_until_200(health_server: str) -> None:
    lines: list[str] = []
    waited = wait_ready(health_server, timeout=30, on_progress=lines.append, interval=0.05)
    assert 0.1 <= waited < 30


async def test_wait_ready_async_polls_until_200(health_server: str) -> None:
    waited = await wait_ready_async(health_server, timeout=30, interval=0.05)
    assert 0.1 <= waited < 30


async def test_wait_ready_async_reports_connection_errors_on_timeout() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(WorkerTimeoutError, match="ConnectError"):
        await asyncio.wait_for(wait_ready_async(url, timeout=0.5, interval=0.1), timeout=30)


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_what_a_killed_worker_left_in_shared_memory_is_removed(tmp_path: Path, end: str) -> None:
    """stop() (SIGTERM ignored, so SIGKILL) and kill() (a crash): SGLang's files go, the store's stay. So does a
    semaphore its short-lived children made and left (held by no one), but not one another process holds."""
    tag = uuid.uuid4().hex[:10]
    names = {"loads": f"sglang_loads_test_{tag}.shm", "semaphore": f"sem.mp-{tag}",
             "multimodal": f"sgl_shm_mm_{tag}", "store": f"revisit-test-{tag}"}
    orphan, elsewhere = Path(f"/dev/shm/sem.mp-orphan{tag}"), Path(f"/dev/shm/sem.mp-other{tag}")
    script = f"""
        import mmap, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # killed, as SGLang's children are: no cleanup of its own
        open("{orphan}", "wb").write(bytes(32))  # made and let go, as by a child that exited
        import os
        open(f"/dev/shm/sgl_shm_mm_{{os.getpid()}}_{tag}", "wb").write(bytes(64))  # SGLang's pid-stamped, closed
        held = []
        for name in {sorted(names.values())!r}:
            f = open("/dev/shm/" + name, "w+b")
            f.write(bytes(4096))
            f.flush()
            held.append((f, mmap.mmap(f.fileno(), 4096)))
        print("ready", flush=True)
        time.sleep(600)
    """
    worker = _worker_running(script, tmp_path)
    deadline = time.monotonic() + 30
    while "ready" not in worker.log_file.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    other = elsewhere.open("w+b")  # a live process's semaphore, made meanwhile: not the worker's to remove
    other.write(bytes(32))
    other.flush()
    mapped = mmap.mmap(other.fileno(), 32)
    try:
        code = worker.stop(grace=0.5) if end == "stop" else worker.kill()
        assert code == -signal.SIGKILL and not worker.live_processes()
        left = {kind: (Path("/dev/shm") / name).exists() for kind, name in names.items()}
        assert left == {"loads": False, "semaphore": False, "multimodal": False, "store": True}
        assert not orphan.exists() and elsewhere.exists()
        assert not list(Path("/dev/shm").glob(f"sgl_shm_mm_*_{tag}"))
    finally:
        mapped.close()
        other.close()
        stamped = Path("/dev/shm").glob(f"sgl_shm_mm_*_{tag}")
        for path in [orphan, elsewhere, *stamped, *(Path("/dev/shm") / name for name in names.values())]:
            path.unlink(missing_ok=True)


def test_the_workers_api_key_goes_in_a_private_file_that_sglang_reads_back(tmp_path: Path) -> None:
    import argparse
    import stat

    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    from launcher.launch import key_off_the_command_line

    key = "sk-worker-" + "a1" * 20
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", "/m", "--api-key", key, "--port", "1"]
    folder = tmp_path / "keys"
    moved = key_off_the_command_line(argv, folder)
    assert key not in " ".join(moved) and "--api-key" not in moved
    path = Path(moved[moved.index("--config") + 1])
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)  # SGLang's own parser and its own reading of --config
    merged = parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(moved[3:]))
    assert merged.api_key == key and merged.model_path == "/m" and merged.port == 1
    assert key_off_the_command_line(argv[:5], folder) == argv[:5]  # no key: nothing to move
    own = [*argv, "--config", "/etc/mine.yaml"]
    assert key_off_the_command_line(own, folder) == own  # SGLang takes one --config: the operator's stays
