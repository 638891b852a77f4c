"""The ``revisit`` console command, run as a user would: a real process, real workers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from store import StoreConfig
from tests.conftest import free_port, remove_store_memory
from tests.images_lib import data_url, encode, small
from tests.videos_lib import encode_video, pan

REVISIT = str(Path(sys.executable).parent / "revisit")


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.sglang
def test_serve_starts_workers_shows_progress_and_stops_them_on_sigterm(model_path, tmp_path):
    port, worker_port = free_port(), free_port()
    dram = Path("/dev/shm") / f"revisit-cli-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "REVISIT_STORE_DRAM_DIR": str(dram), "REVISIT_STORE_LMDB_DIR": str(tmp_path / "lmdb"),
           "REVISIT_ADMIN_TOKEN": "cli-test-token", "REVISIT_BOOKS_INTERVAL_S": "0.5"}
    process = subprocess.Popen(
        [REVISIT, "serve", "--workers", "2", "--port", str(port), "--worker-port", str(worker_port),
         "--log-dir", str(tmp_path), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while not any("ready:" in line for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stdout.readline())
        output = "".join(lines)
        assert "starting 2 SGLang worker(s) on cpu" in output
        assert "worker 0 ready" in output and "worker 1 ready" in output
        ready = [line for line in lines if "ready:" in line]
        assert len(ready) == 1 and f"http://127.0.0.1:{port}/v1" in ready[0]
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0) as client:
            model = client.models.list().data[0].id
            response = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=3
            )
            assert response.choices[0].message.content
            # Reuse is on as configured: an image seen before, after other text, is reused position-independently.
            image = data_url(encode(small("chelsea.png", (112, 112))))

            def ask(preamble: str):
                return client.chat.completions.with_raw_response.create(model=model, max_completion_tokens=2,
                                                                        messages=[{"role": "user", "content": [
                    {"type": "text", "text": preamble}, {"type": "image_url", "image_url": {"url": image}}]}])

            assert ask("Look:").headers["x-revisit-reuse"] == "miss"
            admin = {"Authorization": "Bearer cli-test-token"}
            deadline = time.monotonic() + 120
            while httpx.get(f"http://127.0.0.1:{port}/admin/stats", headers=admin).json()["tiers"]["dram"][
                    "entries"] < 1:
                assert time.monotonic() < deadline, "the worker never stored the image"
                time.sleep(0.2)
            assert ask("Before it, other words. Look:").headers["x-revisit-reuse"] == "exact_moved"
            # What drop-in clients send besides: a video, and a text completion.
            video = {"type": "video_url", "video_url": {"url": data_url(encode_video(pan(frames=8)), "video/mp4")}}
            raw = client.chat.completions.with_raw_response.create(
                model=model, max_completion_tokens=2, messages=[{"role": "user", "content": [
                    video, {"type": "text", "text": "What happens?"}]}])
            assert raw.headers["x-revisit-video-frames"].startswith("4;") and raw.parse().choices
            assert client.completions.create(model=model, prompt="Once upon", max_tokens=2).choices[0].text
        assert (tmp_path / "worker-0.log").stat().st_size > 0
    finally:
        process.send_signal(signal.SIGTERM)  # as docker stop or systemd would
        try:
            code = process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    rest = process.stdout.read()
    assert code == 0, rest
    assert "stopping 2 worker(s)" in rest
    assert "Traceback" not in "".join(lines) + rest
    assert not port_open(worker_port) and not port_open(worker_port + 1) and not port_open(port)
    remove_store_memory(StoreConfig(dram_dir=dram))


def test_serve_refuses_a_folder_that_is_not_a_model(tmp_path):
    result = subprocess.run([REVISIT, "serve", "--model", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "is not a model folder" in result.stderr


def test_gateway_without_settings_names_what_is_missing():
    env = {k: v for k, v in os.environ.items() if not k.startswith("REVISIT_")}
    result = subprocess.run([REVISIT, "gateway"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert "REVISIT_MODEL" in result.stderr and "REVISIT_WORKERS" in result.stderr
