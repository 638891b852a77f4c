"""Worker failures: retried before anything was streamed, a clean error event after, 503 with none."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import WORKER_READY_TIMEOUT_S, gateway_config, run_gateway, start_worker
from tests.images_lib import data_url, encode, small

pytestmark = pytest.mark.sglang

IMAGE = data_url(encode(small("chelsea.png", (84, 84))))
MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                         {"type": "text", "text": "Describe it."}]}]


def kill(worker) -> None:
    """A crash (SIGKILL of its group); what SGLang then leaves in /dev/shm goes too (WorkerProcess.kill)."""
    worker.kill()


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


@pytest.fixture
def revive(workers, model_path, tmp_path, gateway):
    """Restart any killed session worker on its old port once the test is done."""
    yield
    pool = gateway.app.state.services.pool
    for index, worker in enumerate(workers):
        if worker.is_running():
            continue
        fresh = start_worker(model_path, tmp_path, port=worker.spec.port)
        fresh.wait_ready(WORKER_READY_TIMEOUT_S)
        workers[index] = fresh
    wait_until(lambda: all(w.healthy for w in pool.workers))


@pytest.fixture
def unwatched_gateway(workers, model_path):
    """A gateway whose health checks run only at start, so only a failed request can reveal a dead worker."""
    server = run_gateway(gateway_config(model_path, [w.url for w in workers], health_interval_s=3600))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_killed_worker_next_request_served_by_the_other(unwatched_gateway, workers, revive, stream):
    gateway = unwatched_gateway
    pool = gateway.app.state.services.pool
    assert all(w.healthy for w in pool.workers)
    victim = workers[1]
    kill(victim)
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0) as client:
        # Dispatch alternates between idle workers, so two requests reach the dead one's turn.
        for _ in range(2):
            kwargs = dict(model=gateway.config.model, messages=MESSAGES, max_completion_tokens=3, temperature=0)
            if stream:
                chunks = list(client.chat.completions.create(**kwargs, stream=True))
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                assert client.chat.completions.create(**kwargs).choices[0].message.content
    down = next(w for w in pool.workers if w.url == victim.url)
    assert not down.healthy and down.failures == 1
    health = httpx.get(gateway.url + "/health").json()
    assert health["status"] == "ok"
    assert [w["healthy"] for w in health["workers"] if w["url"] == victim.url] == [False]


def test_worker_dying_mid_stream_ends_with_an_error_event(client, gateway, workers, revive):
    pool = gateway.app.state.services.pool
    stream = client.chat.completions.create(
        model=gateway.config.model, messages=MESSAGES, max_completion_tokens=3000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for _ in stream:
            received += 1
            if received == 2:
                busy = [w for w in pool.workers if w.inflight > 0]
                assert len(busy) == 1
                kill(next(p for p in workers if p.url == busy[0].url))
    assert received >= 2


def test_no_healthy_worker_is_a_503(model_path, tmp_path):
    dead = run_gateway(gateway_config(model_path, ["http://127.0.0.1:9"]))
    try:
        assert httpx.get(dead.url + "/health").status_code == 503
        response = httpx.post(dead.url + "/v1/chat/completions",
                              json={"model": dead.config.model, "messages": MESSAGES, "max_tokens": 2})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
    finally:
        dead.stop()
