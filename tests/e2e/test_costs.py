"""Each worker's costs, measured by the gateway when the worker comes up and refitted from what it serves alone."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from gateway.calibration import WorkerCosts
from gateway.costs import FEATURES, CostModel, Costs
from tests.conftest import gateway_config, run_gateway
from tests.e2e.test_reuse import wait_stored
from tests.images_lib import data_url, encode, small

pytestmark = pytest.mark.sglang

TOKEN = "admin-token-for-costs"


@pytest.fixture(scope="module")
def measuring(workers, model_path):
    """A gateway of its own in front of the session's workers, with the admin API on: it measures them anew. No
    store (LMDB opens one environment per process: the session gateway's)."""
    server = run_gateway(gateway_config(model_path, [w.url for w in workers], admin_token=TOKEN, calibrate=True))
    try:
        yield server
    finally:
        server.stop()


def costs(gateway) -> dict:
    services = gateway.app.state.services
    assert services.costs is not None, "the tests' gateway knows its model's facts, so it measures its workers"
    deadline = time.monotonic() + 120
    while True:
        snapshot = services.costs.snapshot()["workers"]
        if len(snapshot) == len(gateway.config.workers) and all("costs" in s for s in snapshot.values()):
            return snapshot
        assert not any("error" in (s.get("calibration") or {}) for s in snapshot.values()), snapshot
        assert time.monotonic() < deadline, f"the workers were never calibrated: {snapshot}"
        time.sleep(0.5)


def test_every_worker_is_measured_when_it_comes_up(measuring) -> None:
    for url, worker in costs(measuring).items():
        probes = worker["calibration"]["probes"]
        assert len(probes) == 7 and all(p["seconds"] > 0 for p in probes), probes
        assert [bool(p["work"].get("vision_patches")) for p in probes] == [False] * 3 + [True] * 3 + [False]
        # the tests' workers attend with torch_native: the last image again, held by SGLang's prefix cache
        assert probes[-1]["work"].get("padded_pairs") and not probes[-1]["work"].get("vision_patches")
        measured = worker["costs"]
        assert set(measured) == set(FEATURES)
        # Prefill and the request's own cost are what every prediction rests on: the probes must find them.
        assert measured["token_layers"] > 0 and measured["request"] > 0, (url, measured)
        # What the probes cannot exercise starts from the prefill: the executor's loop no cheaper than SGLang's.
        assert measured["planned_token_layers"] >= measured["token_layers"]
    # the tests' CPU workers attend with torch_native: an extend after a cached prefix attends as the whole prompt
    assert [w.pads_extends for w in measuring.app.state.services.pool.workers] == [True] * len(measuring.config.workers)


def test_the_admin_stats_show_the_costs(measuring) -> None:
    costs(measuring)
    stats = httpx.get(measuring.url + "/admin/stats", timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}).json()
    workers = stats["worker_costs"]["workers"]
    assert set(workers) == set(measuring.config.workers)
    assert all(w["costs"]["token_layers"] > 0 for w in workers.values())


def test_a_request_served_alone_is_a_sample(measuring) -> None:
    costs(measuring)
    services = measuring.app.state.services
    before = sum(model.observed for model in services.costs.models.values())
    picture = data_url(encode(small("coffee.png", (112, 112))))
    for _ in range(2):
        with httpx.stream("POST", measuring.url + "/v1/chat/completions", timeout=120,
                          headers={"Authorization": "Bearer sk-costs"},
                          json={"model": "revisit-tiny", "max_tokens": 4, "temperature": 0, "stream": True,
                                "messages": [{"role": "user", "content": [
                                    {"type": "image_url", "image_url": {"url": picture}},
                                    {"type": "text", "text": "Describe it."}]}]}) as response:
            assert response.status_code == 200
            response.read()
    after = sum(model.observed for model in services.costs.models.values())
    assert after - before == 2
    # What the costs predicted for them, before they were samples, by what ran (no store here: plain SGLang).
    assert services.costs.accuracy()["plain"]["requests"] >= 2
    # Not streamed and more than one token: its time is not a time to first token, so no sample.
    httpx.post(measuring.url + "/v1/chat/completions", timeout=120, json={
        "model": "revisit-tiny", "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]}).raise_for_status()
    assert sum(model.observed for model in services.costs.models.values()) == after
    # Not streamed, one token: its answer is its first token.
    httpx.post(measuring.url + "/v1/chat/completions", timeout=120, json={
        "model": "revisit-tiny", "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]}).raise_for_status()
    assert sum(model.observed for model in services.costs.models.values()) == after + 1


def test_a_repeat_sglangs_prefix_cache_serves_is_priced_as_served(measuring) -> None:
    """The gateway takes a worker's prefix cache to hold the prompts it sent it: a repeat on the same worker is a
    sample priced without the image's vision pass and prefill (or one SGLang served in a fraction of the time would
    pull the fit's vision costs to nothing). Checked against what SGLang says it served from its cache."""
    costs(measuring)
    services = measuring.app.state.services
    picture = data_url(encode(small("astronaut.png", (168, 168))))
    key = f"sk-{uuid.uuid4().hex}"
    ran = []
    for _ in range(3):  # two workers: two of three on one of them
        response = httpx.post(measuring.url + "/v1/chat/completions", timeout=120,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": "revisit-tiny", "max_tokens": 1, "temperature": 0, "messages": [
                                  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                                               {"type": "text", "text": "Describe it."}]}]})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        ran.append((services.costs.snapshot()["recent"][-1], cached))
    for sample, cached in ran:
        held = sample["kind"] == "prefix_cached"
        # taken as held exactly where SGLang served the image (6 x 6 tokens at 168 px) from its cache
        assert held == (cached > 36), (sample, cached)
        assert bool(sample["work"].get("vision_patches")) != held, sample
        assert sample["work"].get("attention_pairs")  # the text still attends over it
    assert [sample["kind"] == "prefix_cached" for sample, _ in ran].count(True) >= 1, ran


def ask(gateway, picture: str, key: str) -> httpx.Headers:
    response = httpx.post(gateway.url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {key}"},
                          json={"model": "revisit-tiny", "max_tokens": 2, "temperature": 0, "messages": [
                              {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                                           {"type": "text", "text": "Describe it."}]}]})
    assert response.status_code == 200, response.text
    return response.headers


def test_a_plan_predicted_not_to_pay_is_not_sent(gateway) -> None:
    """The same stored image, once under costs where reading its K/V costs more than computing it (plain SGLang
    then: computed, not stored again), once under costs where reading is cheap (an exact hit). On the session's
    gateway (it holds the store), its planner given the workers' costs for the test."""
    services = gateway.app.state.services
    picture = data_url(encode(small("chelsea.png", (168, 168))))
    key = f"sk-{uuid.uuid4().hex}"
    first = ask(gateway, picture, key)
    assert first["x-revisit-reuse"] == "miss"
    wait_stored(gateway, first["x-revisit-image-keys"])
    assert gateway.config.model_facts is not None
    costs = WorkerCosts(gateway.config.model_facts, gateway.config.model,
                        gateway.config.processor, services.pool, services.client)
    planner = services.planner
    before = planner.refused["cost"]
    try:
        planner.costs = costs
        dear = Costs.of(request=0.01, token_layers=1e-6, vision_patches=1e-6, read_token_layers=1.0)
        costs.models = {url: CostModel(dear) for url in gateway.config.workers}
        # stored, and refused: nearest is the image itself
        assert ask(gateway, picture, key)["x-revisit-reuse"] == "miss;nearest=1.0000;refused=cost"
        assert planner.refused["cost"] == before + 1
        cheap = Costs.of(request=0.01, token_layers=1e-3, vision_patches=1e-3, read_token_layers=1e-9)
        costs.models = {url: CostModel(cheap) for url in gateway.config.workers}
        # sent as planned (SGLang's prefix cache may hold the image from the miss above: ";prefix_cached")
        assert ask(gateway, picture, key)["x-revisit-reuse"].split(";")[0] == "exact_same_prefix"
        assert planner.refused["cost"] == before + 1
    finally:
        planner.costs = None
