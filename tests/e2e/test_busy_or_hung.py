"""Health that tells busy from hung: a worker deaf to /health because another client's long prefill holds its
scheduler stays in rotation; one whose scheduler stopped is taken out, and comes back when it runs again. A real
SGLang CPU worker of its own (its scheduler is stopped here), behind a gateway that checks every 0.2 s."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx
import psutil
import pytest

from tests.conftest import MODEL_ID, WORKER_READY_TIMEOUT_S, gateway_config, run_gateway, start_worker

pytestmark = pytest.mark.sglang

CHECKS = {"health_interval_s": 0.2, "health_timeout_s": 2.0}  # SGLang answers /health in 1 s at best


@pytest.fixture(scope="module")
def lone(model_path, tmp_path_factory):
    worker = start_worker(model_path, tmp_path_factory.mktemp("lone-worker"))
    try:
        worker.wait_ready(WORKER_READY_TIMEOUT_S)
        server = run_gateway(gateway_config(model_path, [worker.url], **CHECKS))
        try:
            yield worker, server
        finally:
            server.stop()
    finally:
        worker.stop()


def scheduler_of(worker) -> psutil.Process:
    children = psutil.Process(worker.pid).children(recursive=True)
    return next(p for p in children if "scheduler" in " ".join(p.cmdline()) or "scheduler" in p.name())


def until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_worker_busy_with_another_clients_long_prefill_stays_up(lone):
    worker, gateway = lone
    pool_worker = gateway.app.state.services.pool.workers[0]
    # Other clients, straight to the worker: two prompts of ~23k tokens of text each at once (46k of the worker's
    # 64k), prefills of some 7 to 15 s each (in chunks) on this CPU, during which SGLang's /health answers nothing.
    # Two, so that a faster machine still holds the scheduler through the three unanswered checks.
    bodies = [{"model": MODEL_ID, "max_tokens": 1, "messages": [{"role": "user", "content": uuid.uuid4().hex + " " +
                                                                 " ".join(f"w{i % 997}" for i in range(6000))}]}
              for _ in range(2)]
    done = threading.Event()

    def one(body: dict) -> None:
        httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=900).raise_for_status()

    def other_client() -> None:
        threads = [threading.Thread(target=one, args=(body,)) for body in bodies]
        try:
            for started in threads:
                started.start()
            for started in threads:
                started.join()
        finally:
            done.set()

    thread = threading.Thread(target=other_client)
    thread.start()
    try:
        until(lambda: pool_worker.busy_since is not None or done.is_set(), "the worker never looked busy")
        assert not done.is_set(), "the prefill ended before /health went unanswered: use a longer prompt"
        unanswered, down = 0, 0
        while not done.is_set():  # every check while the prefill runs: /health unanswered, but busy, so up
            before = pool_worker.last_checked
            until(lambda before=before: pool_worker.last_checked > before or done.is_set(), "no health check ran")
            if done.is_set():
                break
            unanswered += pool_worker.busy_since is not None and pool_worker.last_error is not None
            down += not pool_worker.healthy
        assert down == 0 and unanswered >= 3  # the 3 misses in a row that take a silent worker out
        listed = httpx.get(gateway.url + "/health").json()["workers"][0]
        assert listed["healthy"]
    finally:
        thread.join(timeout=900)


def test_a_worker_whose_scheduler_hangs_is_taken_out_and_comes_back(lone):
    worker, gateway = lone
    pool_worker = gateway.app.state.services.pool.workers[0]
    until(lambda: pool_worker.healthy and pool_worker.busy_since is None, "the worker is not idle and up")
    scheduler = scheduler_of(worker)
    os.kill(scheduler.pid, signal.SIGSTOP)  # its HTTP process still answers; its scheduler never will
    try:
        until(lambda: not pool_worker.healthy, "a hung worker stayed in rotation", timeout=30)
        assert pool_worker.busy_since is None and "health" in (pool_worker.last_error or "")
        assert httpx.get(gateway.url + "/health").status_code == 503
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    until(lambda: pool_worker.healthy, "the worker did not come back once its scheduler ran again", timeout=60)
