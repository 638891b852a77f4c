"""Session fixtures: the bundled tiny model, real SGLang CPU workers, a real gateway server."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig, ProcessorSettings, ReuseSettings, TenantSettings
from store import StoreConfig
from tests.waiting import wait_until

# Under pytest's own limit a test (pyproject's timeout, 600 s): a worker that is not ready in time fails with its log
# and what else ran on the machine (machine_snapshot), not with pytest's bare timeout. A worker starts in 1-2 minutes
# on two cores.
WORKER_READY_TIMEOUT_S = 420
MODEL_ID = "revisit-tiny"


def terminate(process, timeout: float = 30.0) -> int:
    """SIGTERM a process started in a session of its own (as docker stop or systemd would), wait for it; on a
    timeout kill its whole group and raise. Returns its exit code."""
    import signal
    import subprocess

    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


def start_gateway_process(env: dict[str, str], port: int, *, log_file: Path | None = None, path: str = "/health",
                          ready=lambda response: response.status_code == 200, timeout: float = 60.0):
    """A real ``revisit gateway`` process on ``port``, with ``env`` over this process's environment, in a session of
    its own (stop it with ``terminate``); returns once GET ``path`` answers what ``ready`` accepts."""
    import subprocess
    import sys

    log = open(log_file, "wb") if log_file is not None else None  # noqa: SIM115 (the child's)
    # Open mode unless the test lists keys: these tests are about what a gateway does, not about who may call it
    # (tests/security is).
    auth = {} if "REVISIT_API_KEYS_FILE" in env or "REVISIT_AUTH" in env else {"REVISIT_AUTH": "open"}
    process = subprocess.Popen([str(Path(sys.executable).parent / "revisit"), "gateway", "--port", str(port),
                                "--log-level", "info"], env={**os.environ, **auth, **env}, stdout=log,
                               stderr=subprocess.STDOUT if log is not None else None, start_new_session=True)
    if log is not None:
        log.close()
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"the gateway exited ({process.returncode}); see {log_file}"
        try:
            if ready(httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)):
                return process
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the gateway did not become ready; see {log_file}"
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private bundled-model cache for tests that build models themselves."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_models(model_cache: Path) -> dict[str, Path]:
    """arch -> directory of its tiny bundled model, built into model_cache."""
    from bundled import ARCHS, TINY, build_model

    return {arch: build_model(arch, TINY, cache_dir=model_cache) for arch in ARCHS}


@pytest.fixture(scope="session")
def astronaut():
    from PIL import Image
    from skimage import data

    return Image.fromarray(data.astronaut())


@pytest.fixture(scope="session")
def coffee():
    from PIL import Image
    from skimage import data

    return Image.fromarray(data.coffee())


@pytest.fixture(scope="session")
def model_path() -> Path:
    from bundled import DEFAULT_ARCH, build_model

    return build_model(DEFAULT_ARCH, "tiny")


@pytest.fixture(scope="session")
def mooncake_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A real Mooncake Store cluster on loopback: a master and one storage node lending 512 MiB."""
    from launcher.mooncake import MooncakeCluster

    with MooncakeCluster.start(tmp_path_factory.mktemp("mooncake"), segment_bytes=512 << 20) as cluster:
        yield cluster


def start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    """A real Redis server on loopback (Debian's redis-server), answering PING: its process and URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (make test installs Debian's)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no", "--dir", str(folder)], stdout=open(folder / "redis.log", "wb"),  # noqa: SIM115
                               stderr=subprocess.STDOUT, start_new_session=True)

    def answers() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited; see {folder / 'redis.log'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    try:
        wait_until(answers, f"redis-server to answer (see {folder / 'redis.log'})", timeout=20)
    except BaseException:
        process.kill()
        raise
    return process, f"redis://127.0.0.1:{port}/0"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis server for books shared by gateways; its URL."""
    process, url = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        terminate(process)


# The store the session's workers and gateway share (REVISIT_STORE_* for workers), set by the shared_store fixture.
STORE_ENV: dict[str, str] = {}


@pytest.fixture(scope="session", autouse=True)
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreConfig]:
    """A store for this test session: shared-memory files under /dev/shm and LMDB in a temporary folder."""
    dram = Path(tempfile.mkdtemp(prefix="revisit-test-store-", dir="/dev/shm"))
    lmdb_dir = tmp_path_factory.mktemp("store-lmdb")
    STORE_ENV.update({"REVISIT_STORE_DRAM_DIR": str(dram), "REVISIT_STORE_LMDB_DIR": str(lmdb_dir)})
    try:
        yield StoreConfig.from_env(STORE_ENV)
    finally:
        remove_store_memory(StoreConfig(dram_dir=dram))


def remove_store_memory(config: StoreConfig) -> None:
    """A test store's shared-memory folders: its DRAM tier and the outcomes box beside it (plan.outcome)."""
    for path in (config.dram_path, config.outcomes_path):
        shutil.rmtree(path, ignore_errors=True)


def start_worker(model_path: Path, log_dir: Path, port: int | None = None):
    from launcher import WorkerSpec
    from launcher import start_worker as launch

    port = port or free_port()
    spec = WorkerSpec(model_path=model_path, port=port, served_model_name=MODEL_ID,
                      log_file=log_dir / f"worker-{port}.log", env=dict(STORE_ENV))
    return launch(spec)


def machine_snapshot(top: int = 8) -> str:
    """The load and the processes that have used the most CPU for their age (a leaked process spinning since an
    earlier test shows as ~100%): what a worker that starts too slowly competed with."""
    import psutil

    now, busy = time.time(), []
    for proc in psutil.process_iter():
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                share = 100 * (times.user + times.system) / max(now - proc.create_time(), 1.0)
                busy.append((share, proc.pid, proc.ppid(), proc.memory_info().rss >> 20,
                             " ".join(proc.cmdline())[:160]))
        except psutil.Error:
            continue
    busy.sort(reverse=True)
    lines = [f"load average {os.getloadavg()}, memory available {psutil.virtual_memory().available >> 20} MiB, "
             f"/dev/shm free {shutil.disk_usage('/dev/shm').free >> 20} MiB; the busiest processes for their age:"]
    lines += [f"  {cpu:5.0f}% pid {pid} (parent {ppid}) {rss} MiB  {cmd}" for cpu, pid, ppid, rss, cmd in busy[:top]]
    return "\n".join(lines)


def wait_workers_ready(started: list) -> None:
    """Wait for workers started side by side; one not ready in time fails with its log and the machine's state."""
    from launcher.errors import WorkerTimeoutError

    async def wait_all() -> None:
        await asyncio.gather(*(w.wait_ready_async(WORKER_READY_TIMEOUT_S) for w in started))

    try:
        asyncio.run(wait_all())
    except WorkerTimeoutError as exc:
        raise WorkerTimeoutError(f"{exc}\n--- the machine ---\n{machine_snapshot()}") from None


@pytest.fixture(scope="session")
def workers(model_path, tmp_path_factory) -> Iterator[list]:
    """Two real SGLang CPU workers, started side by side."""
    log_dir = tmp_path_factory.mktemp("worker-logs")
    started = [start_worker(model_path, log_dir) for _ in range(2)]
    try:

        wait_workers_ready(started)
        yield started
    finally:
        for worker in started:
            worker.stop()


@dataclass
class GatewayServer:
    url: str
    config: GatewayConfig
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def app(self):
        return self.server.config.app

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def run_gateway(config: GatewayConfig) -> GatewayServer:
    """A real uvicorn server on loopback, in a thread with its own event loop."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("gateway did not start")
        time.sleep(0.05)
    return GatewayServer(url=f"http://127.0.0.1:{port}", config=config, server=server, thread=thread)


def gateway_config(model_path: Path, worker_urls: list[str], *, store: StoreConfig | None = None,
                   **overrides) -> GatewayConfig:
    """A gateway for tests, in open mode unless ``tenants`` says otherwise; with store, it plans reuse over it
    (uniform ratios over the model's layers)."""
    settings = {"health_interval_s": 0.5, "tenants": TenantSettings.open(), **overrides}
    if store is not None:
        settings["reuse"] = ReuseSettings.for_model(model_path, store=store)
    from gateway.costs import ModelFacts
    from plan.checkpoint import longest_token_chars, vocab_size

    # Workers are not measured (the probes would show in the workers' counts that tests read) and every plan that can
    # be made is sent: the tests of the reuse paths need them on a model where they do not pay.
    # tests/e2e/test_costs.py turns both on.
    settings = {"model_facts": ModelFacts.from_model_dir(model_path), "calibrate": False, "plan_by_cost": False,
                **settings}
    return GatewayConfig(
        model=MODEL_ID, workers=tuple(worker_urls), processor=ProcessorSettings.from_model_dir(model_path),
        vocab_size=vocab_size(model_path), max_token_chars=longest_token_chars(model_path), **settings
    )


@pytest.fixture(scope="session")
def gateway(workers, model_path, shared_store) -> Iterator[GatewayServer]:
    server = run_gateway(gateway_config(model_path, [w.url for w in workers], store=shared_store))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client(gateway):
    import openai

    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-test", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="session")
def async_client(gateway):
    import openai

    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-test", max_retries=0, timeout=300)


def worker_events(urls) -> Counter:
    """What the engine extension executed, summed over these workers: revisit_worker_events_total by event, and
    revisit_worker_fallbacks_total as "fallback:<plan>:<cause>", read from each worker's /metrics (see
    engine_ext/executor/events.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: Counter = Counter()
    for url in urls:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            if family.name == "revisit_worker_events":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        totals[sample.labels["event"]] += int(sample.value)
            elif family.name == "revisit_worker_fallbacks":  # as ExecutionEvents.counts names them
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        totals[f"fallback:{sample.labels['plan']}:{sample.labels['cause']}"] += int(sample.value)
    return totals
