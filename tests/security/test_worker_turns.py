"""One key's many requests do not fill a worker's queue ahead of another key's (gateway/turns.py), with a real
gateway and a real SGLang worker.

Before: a key that sent a hundred small requests at once had all those admitted (64) at the worker, which served
them first come, first served: every other key's next request waited behind them all.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway import turns as turns_module
from gateway.config import AdmissionLimits, TenantSettings
from gateway.turns import CPU_PER_KEY
from tests.conftest import MODEL_ID, gateway_config, run_gateway

pytestmark = pytest.mark.sglang

ALICE, BOB = "sk-alice-" + "1" * 20, "sk-bob-" + "2" * 20
PER_KEY = 3


def at_worker(worker_url: str) -> int:
    loads = httpx.get(worker_url + "/v1/loads", params={"include": "core"}, timeout=10).json()["loads"]
    return sum(load["num_running_reqs"] + load.get("num_waiting_reqs", 0) for load in loads)


def ask(url: str, key: str, tokens: int) -> int:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "count"}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=300).status_code


@pytest.fixture
def gateway_of_two_keys(workers, model_path):
    config = gateway_config(model_path, [workers[0].url], tenants=TenantSettings.with_keys({ALICE: "a", BOB: "b"}),
                            admission=AdmissionLimits(worker_requests_per_key=PER_KEY))
    server = run_gateway(config)
    try:
        yield server, workers[0].url
    finally:
        server.stop()


def test_a_key_sending_many_requests_has_at_most_its_share_at_the_worker_while_another_key_waits(
        gateway_of_two_keys, monkeypatch):
    # The share alone, unpaced (pacing holds a flood's waiting requests back further: tests/gateway/test_turns.py,
    # bench/dos_under_load.py): at her share per 2 s, Alice's twenty would outlast Bob's answer, and she would have
    # the worker to herself before the end.
    monkeypatch.setattr(turns_module, "PACE_S", 0.0)
    gateway, worker_url = gateway_of_two_keys
    turns = gateway.app.state.services.turns
    peak, sampling = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not sampling.is_set():
            peak = max(peak, at_worker(worker_url))
            time.sleep(0.05)

    with ThreadPoolExecutor(24) as pool:
        bob = pool.submit(ask, gateway.url, BOB, 400)  # a long answer: Bob has a request at the worker throughout
        deadline = time.monotonic() + 60
        while turns.stats()["keys"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        alice = [pool.submit(ask, gateway.url, ALICE, 32) for _ in range(20)]  # each outlasts their sending
        statuses = [future.result() for future in alice]
        sampling.set()
        sampler.join()
        assert bob.result() == 200
    assert statuses == [200] * 20
    # Bob's one request, and never more than Alice's share of hers, at the worker.
    assert 2 <= peak <= PER_KEY + 1, peak
    assert turns.stats()["waited"] >= 20 - PER_KEY, turns.stats()
    assert turns.stats()["paced"]  # a CPU worker, as its /server_info says: pacing is on
    assert turns.stats()["at_workers"] == 0 and turns.stats()["waiting"] == 0


def test_a_key_alone_is_not_held_back(gateway_of_two_keys):
    gateway, _ = gateway_of_two_keys
    turns = gateway.app.state.services.turns
    waited = turns.stats()["waited"]
    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda _: ask(gateway.url, ALICE, 4), range(12)))
    assert statuses == [200] * 12
    assert turns.stats()["waited"] == waited


def test_unset_a_keys_share_follows_the_workers_device_read_from_sglang(workers, model_path):
    config = gateway_config(model_path, [workers[0].url], tenants=TenantSettings.with_keys({ALICE: "a", BOB: "b"}))
    assert config.admission.worker_requests_per_key is None
    server = run_gateway(config)
    try:
        listed = httpx.get(server.url + "/health", timeout=10).json()["workers"][0]
        assert listed["device"] == "cpu"  # from the worker's own /server_info
        read = server.app.state.services.pool.workers[0]  # and what calibration sizes SGLang's caches by
        assert read.attention_backend == "torch_native" and read.kv_tokens is not None and read.kv_tokens > 0
        stats = server.app.state.services.turns.stats()
        assert (stats["per_key"], stats["per_key_by"]) == (CPU_PER_KEY, "devices:cpu")
    finally:
        server.stop()
