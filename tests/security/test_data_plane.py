"""An authenticated data plane: whoever can write the store or reach a worker, but does not hold the deployment
secret, cannot make a request use what they placed. A real SGLang CPU worker and a real gateway share a secret;
the attacker writes the DRAM tier's files and posts to the worker directly. Each forgery ends in a full prefill
with plain SGLang's answer, never in a wrong one. Before entries were sealed and plans authenticated, a copied
entry was a hit for the image it was copied to, and a plan anyone could write was executed."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway.config import TenantSettings
from plan import EXACT, PUBLIC_PLAN_KEY, ImagePlan, RequestPlan, plan_key
from plan.outcome import EVERY_IMAGE, UNPLANNED, Outcome, OutcomeBox
from settings.secret import DataPlaneSecret, worker_api_key
from store import DramTier, Entry, StoreConfig
from store.entry import DTYPES, kv_array, parse_header, seal_entry, split_kv
from store.seal import PUBLIC, EntrySeal
from tests.conftest import MODEL_ID, free_port, gateway_config, remove_store_memory, run_gateway
from tests.e2e.test_reuse import flush_worker_prefix_caches
from tests.images_lib import data_url, encode, small

pytestmark = pytest.mark.sglang

QUESTION = "What is in this image?"
KEY = "sk-data-plane-" + "d" * 20


@pytest.fixture(scope="module")
def secure(model_path, tmp_path_factory):
    """A worker and a gateway sharing a deployment secret and a store."""
    from launcher import WorkerSpec, start_worker

    root = tmp_path_factory.mktemp("data-plane")
    secret = root / "secret"
    DataPlaneSecret.create(secret)
    dram = Path(tempfile.mkdtemp(prefix="revisit-data-plane-", dir="/dev/shm"))
    env = {"REVISIT_STORE_DRAM_DIR": str(dram), "REVISIT_STORE_LMDB_DIR": str(root / "lmdb"),
           "REVISIT_STORE_SECRET_FILE": str(secret)}
    store = StoreConfig.from_env(env)
    worker = start_worker(WorkerSpec(model_path=model_path, port=free_port(), served_model_name=MODEL_ID,
                                     log_file=root / "worker.log", env=env))
    server = None
    try:
        worker.wait_ready(600)
        config = gateway_config(model_path, [worker.url], store=store, books_interval_s=0.5,
                                tenants=TenantSettings.with_keys({KEY: "team"}))
        config = dataclasses.replace(config, secret=DataPlaneSecret.read(secret))
        server = run_gateway(config)
        yield server, worker, store
    finally:
        if server is not None:
            server.stop()
        worker.stop()
        remove_store_memory(store)
        shutil.rmtree(dram, ignore_errors=True)


def picture(name: str) -> str:
    return data_url(encode(small(name, (196, 196))))


def ask(url: str, image: str, *, mode: str = "all") -> httpx.Response:
    body = {"model": MODEL_ID, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": QUESTION}]}]}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {KEY}", "x-revisit-reuse-mode": mode})
    assert response.status_code == 200, response.text
    return response


def answer(response: httpx.Response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def stored(gateway, key: str) -> None:
    store = gateway.app.state.services.cache.store
    deadline = time.monotonic() + 60
    while not store.contains(key) or key not in gateway.app.state.services.policy:
        assert time.monotonic() < deadline, "the entry was never stored and booked"
        time.sleep(0.2)


def test_entries_are_sealed_and_served_under_the_secret(secure):
    gateway, _, store = secure
    first = ask(gateway.url, picture("chelsea.png"))
    key = first.headers["x-revisit-image-keys"]
    stored(gateway, key)
    # So that the worker reads the sealed entry, not SGLang's own prefix cache (its admin API takes the key too).
    flush_worker_prefix_caches(gateway, worker_api_key(DataPlaneSecret.read(store.secret_file)))
    again = ask(gateway.url, picture("chelsea.png"))
    assert again.headers["x-revisit-reuse"] == "exact_same_prefix" and answer(again) == answer(first)
    data = (store.dram_path / f"{key}.kv").read_bytes()
    parse_header(memoryview(data), key=key, seal=EntrySeal.from_file(store.secret_file))
    with pytest.raises(Exception, match="seal"):
        parse_header(memoryview(data), key=key, seal=PUBLIC)  # nobody without the secret can check, or make, one


def test_an_entry_copied_under_another_images_key_is_a_full_prefill(secure):
    gateway, _, store = secure
    source = ask(gateway.url, picture("chelsea.png")).headers["x-revisit-image-keys"]
    stored(gateway, source)
    plain = ask(gateway.url, picture("coffee.png"), mode="off")  # keyed, not stored: plain SGLang's answer
    target = plain.headers["x-revisit-image-keys"]
    shutil.copyfile(store.dram_path / f"{source}.kv", store.dram_path / f"{target}.kv")  # the attacker's copy
    forged = ask(gateway.url, picture("coffee.png"))
    assert forged.headers["x-revisit-reuse"].startswith("miss")
    assert answer(forged) == answer(plain)


def test_an_entry_forged_without_the_secret_is_a_full_prefill(secure):
    gateway, _, store = secure
    source = ask(gateway.url, picture("chelsea.png")).headers["x-revisit-image-keys"]
    stored(gateway, source)
    plain = ask(gateway.url, picture("astronaut.png"), mode="off")
    target = plain.headers["x-revisit-image-keys"]
    # The attacker rebuilds the entry with its K/V changed and every checksum recomputed as the format says,
    # sealed for the target key under the only keys they have (the public ones).
    data = memoryview((store.dram_path / f"{source}.kv").read_bytes())
    header = parse_header(data).header
    k, v = split_kv(kv_array(data, header))
    encoder = np.frombuffer(data[header.encoder_range.start:header.encoder_range.stop],
                            dtype=DTYPES[header.encoder_dtype])
    planted = Entry.from_arrays(model_id=header.model_id, grid=header.grid, positions=header.positions_array(),
                                encoder_output=encoder.reshape(header.encoder_shape),
                                encoder_dtype=header.encoder_dtype, k=k[::-1].copy(), v=v, kv_dtype=header.kv_dtype,
                                seal=PUBLIC)
    seal_entry(planted.data, target, PUBLIC)
    (store.dram_path / f"{target}.kv").write_bytes(planted.data)
    assert DramTier(store.dram_path, seal=EntrySeal.from_file(store.secret_file)).get(target) is None
    forged = ask(gateway.url, picture("astronaut.png"))
    assert forged.headers["x-revisit-reuse"].startswith("miss")
    assert answer(forged) == answer(plain)  # and the worker stored the real entry over the planted one


def test_a_worker_takes_requests_only_with_the_key_derived_from_the_secret(secure):
    gateway, worker, store = secure
    api_key = worker_api_key(DataPlaneSecret.read(store.secret_file))
    body = {"model": MODEL_ID, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer EMPTY"}):
        refused = httpx.post(worker.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert refused.status_code == 401
    assert httpx.get(worker.url + "/health", timeout=60).status_code == 200  # probes need no key
    assert ask(gateway.url, picture("chelsea.png")).status_code == 200  # the gateway holds it
    assert api_key is not None and api_key not in worker.log_file.read_text()  # nor do the worker's logs show it
    for pid in worker.live_processes():  # nor any of its processes' command lines, which every local user can read
        assert api_key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


def test_a_plan_posted_to_a_worker_without_the_secret_is_refused(secure):
    """Even with the worker's API key (leaked, say), a plan not made under the secret is not executed."""
    gateway, worker, store = secure
    api_key = worker_api_key(DataPlaneSecret.read(store.secret_file))
    victim = ask(gateway.url, picture("chelsea.png")).headers["x-revisit-image-keys"]
    stored(gateway, victim)
    image = picture("coffee.png")
    plain = ask(gateway.url, image, mode="off")
    tokens = 49  # 196 x 196 px on the tiny model: a 7 x 7 grid
    forged = RequestPlan(images=(ImagePlan(key=victim, kind=EXACT, tokens=tokens, grid=(7, 7)),))
    for key in (PUBLIC_PLAN_KEY, plan_key(DataPlaneSecret(b"x" * 32))):
        rid = forged.to_rid(uuid.uuid4().hex, key=key)
        body = {"model": MODEL_ID, "max_tokens": 8, "temperature": 0, "rid": rid, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": QUESTION}]}]}
        response = httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=300,
                              headers={"Authorization": f"Bearer {api_key}"})
        assert response.status_code == 200, response.text
        assert answer(response) == answer(plain)  # the victim's K/V were not loaded into the attacker's prompt
        box = OutcomeBox(store.outcomes_path)
        deadline = time.monotonic() + 30
        while (ran := box.take(RequestPlan.request_id(rid) or "")) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ran == {EVERY_IMAGE: Outcome(UNPLANNED, "plan_refused")}
