"""Beyond one host: two "hosts" (each a worker and a gateway process with local folders of their own) share the
mooncake tier of a real Mooncake cluster (a master and a storage node per host) and the books of a real Redis server.

An image stored through worker A behind gateway 1 is an exact hit through worker B behind gateway 2, with the same
answer; killing gateway 1 mid-run loses no entry (gateway 2 serves them all, and gateway 1 comes back with the same
books); a damaged entry in the cluster falls back to a full prefill with the same answer.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from launcher.mooncake import MooncakeCluster
from store import StoreConfig, open_tier
from tests.conftest import (
    MODEL_ID,
    free_port,
    start_gateway_process,
    terminate,
    wait_workers_ready,
    worker_events,
)
from tests.images_lib import data_url, encode, noise_image, png_data_url, small
from tests.waiting import wait_until

pytestmark = pytest.mark.sglang

ADMIN_TOKEN = "scale-out-admin"
QUESTION = "What is in this image?"


@dataclass
class Host:
    """One stand-in host: its store settings (the shared tier, and local folders of its own), its worker, and a
    gateway process in front of that worker."""

    name: str
    env: dict[str, str]
    folder: Path
    worker: object | None = None
    gateway: subprocess.Popen[bytes] | None = None
    gateway_log: Path | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_gateway(self, model_path: Path, books_url: str) -> None:
        self.port = self.port or free_port()
        env = {**self.env, "REVISIT_MODEL": MODEL_ID, "REVISIT_MODEL_DIR": str(model_path),
               "REVISIT_WORKERS": self.worker.url, "REVISIT_BOOKS_URL": books_url,  # type: ignore[attr-defined]
               "REVISIT_ADMIN_TOKEN": ADMIN_TOKEN, "REVISIT_BOOKS_INTERVAL_S": "1",
               "REVISIT_HEALTH_INTERVAL_S": "0.5", "REVISIT_MOONCAKE_CAPACITY_BYTES": str(256 << 20),
               "REVISIT_PLAN_BY_COST": "0", "REVISIT_CALIBRATE": "0"}  # the reuse paths, on a model where
        # they do not pay, and no probes in the workers' counts
        self.gateway_log = self.folder / f"gateway-{time.time():.0f}.log"
        self.gateway = start_gateway_process(
            env, self.port, log_file=self.gateway_log, timeout=120,
            ready=lambda r: r.status_code == 200 and all(w["healthy"] for w in r.json()["workers"]))

    def kill_gateway(self) -> None:
        assert self.gateway is not None
        os.killpg(self.gateway.pid, signal.SIGKILL)
        self.gateway.wait(timeout=30)

    def admin(self, path: str) -> dict:
        response = httpx.get(self.url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module")
def scale_out(model_path, redis_server, tmp_path_factory):
    """Two hosts sharing a Mooncake cluster (a storage node each) and the books; the store named for this module."""
    root = tmp_path_factory.mktemp("scale-out")
    name = f"scale-out-{uuid.uuid4().hex[:8]}"
    cluster = MooncakeCluster.start(root / "mooncake", segment_bytes=384 << 20, nodes=2)
    hosts = []
    try:
        for index in (1, 2):
            folder = root / f"host-{index}"
            folder.mkdir()
            shm = Path(tempfile.mkdtemp(prefix=f"revisit-test-host-{index}-", dir="/dev/shm"))
            env = {**cluster.store_settings(), "REVISIT_STORE_NAME": name, "REVISIT_STORE_TIERS": "mooncake",
                   # what the workers ran reaches the gateways through the books' server, as across real hosts
                   "REVISIT_STORE_OUTCOMES_URL": redis_server,
                   # what stays local to a host: its shared-memory folder and its disk
                   "REVISIT_STORE_DRAM_DIR": str(shm), "REVISIT_STORE_LMDB_DIR": str(folder / "lmdb")}
            hosts.append(Host(name=f"host-{index}", env=env, folder=folder))
        for host in hosts:
            host.worker = start_worker_with(model_path, host)
        wait_workers_ready([h.worker for h in hosts])
        for host in hosts:
            host.start_gateway(model_path, redis_server)
        yield cluster, hosts
    finally:
        for host in hosts:
            if host.gateway is not None and host.gateway.poll() is None:
                terminate(host.gateway)
            if host.worker is not None:
                host.worker.stop()  # type: ignore[attr-defined]
            config = StoreConfig.from_env(host.env)
            for path in (config.dram_path, config.outcomes_path):
                shutil.rmtree(path, ignore_errors=True)
        cluster.stop()


def start_worker_with(model_path: Path, host: Host):
    from launcher import WorkerSpec
    from launcher import start_worker as launch

    port = free_port()
    return launch(WorkerSpec(model_path=model_path, port=port, served_model_name=MODEL_ID,
                             log_file=host.folder / f"worker-{port}.log", env=host.env))


def ask(host: Host, picture: str, *, tokens: int = 10) -> tuple[str, dict[str, str]]:
    """The answer and the response headers, through the official openai client."""
    with openai.OpenAI(base_url=host.url + "/v1", api_key="sk-scale-out", max_retries=0, timeout=300) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_ID, max_tokens=tokens, temperature=0,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                                   {"type": "text", "text": QUESTION}]}])
        headers = dict(raw.headers)
        if "x-revisit-reuse" not in headers:  # planned nothing: the gateway's log says why (the store, the books)
            log = host.gateway_log.read_text(errors="replace")[-4000:] if host.gateway_log else ""
            raise AssertionError(f"{host.name}'s gateway planned nothing for an image; its log ends:\n{log}")
        return raw.parse().choices[0].message.content or "", headers


def booked(host: Host) -> set[str]:
    return {entry["key"] for entry in host.admin("/admin/entries?limit=1000")["data"]}


def test_an_image_stored_through_one_host_is_an_exact_hit_through_the_other(scale_out):
    cluster, (one, two) = scale_out
    picture = data_url(encode(small("coffee.png", (168, 168))))
    first, headers = ask(one, picture)
    key = headers["x-revisit-image-keys"]
    assert headers["x-revisit-reuse"] == "miss"
    wait_until(lambda: key in booked(two), "gateway 2 to book the entry worker A wrote")
    before = worker_events([two.worker.url])  # type: ignore[attr-defined]
    second, headers = ask(two, picture)
    assert headers["x-revisit-reuse"] == "exact_same_prefix"
    assert second == first
    done = worker_events([two.worker.url])  # type: ignore[attr-defined]
    done.subtract(before)
    assert done["exact_executed"] == 1 and done["vision_images"] == 0  # worker B read the KV from the cluster
    # One set of books: both gateways count the hit on the shared tier.
    wait_until(lambda: one.admin("/admin/stats")["hits"]["exact"]["mooncake"] >= 1, "gateway 1 to see the hit")
    stats = two.admin("/admin/stats")
    assert stats["tiers"]["mooncake"]["entries"] >= 1 and stats["books"]["shared"] is True


def test_killing_a_gateway_mid_run_loses_no_entry(scale_out, model_path, redis_server):
    cluster, (one, two) = scale_out
    pictures = [data_url(encode(noise_image(112, 112, seed=100 + i))) for i in range(12)]
    answers: dict[str, str] = {}

    async def through_one() -> None:
        # Two clients' worth of requests at a time, one after another, so that the kill finds some answered, some
        # in flight and some not yet sent.
        slots = asyncio.Semaphore(2)
        async with openai.AsyncOpenAI(base_url=one.url + "/v1", api_key="sk-scale-out", max_retries=0,
                                      timeout=300) as client:
            async def one_request(picture: str) -> None:
                try:
                    async with slots:
                        raw = await client.chat.completions.with_raw_response.create(
                            model=MODEL_ID, max_tokens=6, temperature=0,
                            messages=[{"role": "user", "content": [
                                {"type": "image_url", "image_url": {"url": picture}},
                                {"type": "text", "text": QUESTION}]}])
                        answers[raw.headers["x-revisit-image-keys"]] = raw.parse().choices[0].message.content or ""
                except openai.APIConnectionError:
                    pass  # cut off by the kill

            tasks = [asyncio.create_task(one_request(p)) for p in pictures]
            deadline = time.monotonic() + 300
            while len(answers) < 4:
                assert time.monotonic() < deadline and not all(t.done() for t in tasks), "no answers came"
                await asyncio.sleep(0.05)
            one.kill_gateway()  # mid-run: the other requests are in flight or not yet sent
            await asyncio.gather(*tasks)

    asyncio.run(through_one())
    assert 4 <= len(answers) < len(pictures), "the kill came after every answer: not mid-run"
    # Every entry the workers stored is in gateway 2's books (it reconciles the shared store every second), those
    # of the requests the kill cut off included ...
    tier = open_tier("mooncake", StoreConfig.from_env(two.env))
    try:  # the requests answered stored their entries; those cut off may still be finishing on worker A
        stored = wait_until(lambda: (keys := set(tier.keys())) >= set(answers) and keys,
                            "worker A to store every answered request's entry")
    finally:
        tier.close()
    wait_until(lambda: stored <= booked(two), "gateway 2 to book every entry stored through gateway 1")
    # ... and an exact hit through host 2, with the answer host 1 gave.
    for picture in pictures:
        answer, headers = ask(two, picture, tokens=6)
        if headers["x-revisit-image-keys"] in answers:
            assert headers["x-revisit-reuse"] == "exact_same_prefix"
            assert answer == answers[headers["x-revisit-image-keys"]]
    # Gateway 1 comes back with the same books.
    one.start_gateway(model_path, redis_server)
    wait_until(lambda: booked(one) == booked(two), "the restarted gateway to hold the same books")
    stats_one, stats_two = one.admin("/admin/stats"), two.admin("/admin/stats")
    assert stats_one["tiers"] == stats_two["tiers"] and stats_one["hits"] == stats_two["hits"]


@pytest.mark.parametrize("where,header", [
    # found before the forward: the whole image is computed as after a miss
    ("encoder", "miss;planned=exact_same_prefix;fallback=entry_damaged"),
    # found mid-forward, when the worker reads the damaged block: its rows are computed from that layer on
    ("kv", "exact_same_prefix;degraded=kv_read_failed"),
])
def test_a_damaged_entry_in_the_cluster_falls_back_to_computing_it(scale_out, where, header):
    cluster, (one, two) = scale_out
    picture = data_url(encode(small("astronaut.png" if where == "kv" else "rocket.jpg", (140, 140))))
    first, headers = ask(one, picture)
    key = headers["x-revisit-image-keys"]
    tier = open_tier("mooncake", StoreConfig.from_env(one.env))
    try:
        wait_until(lambda: tier.contains(key), "worker A to store the entry")
        with tier.get(key) as view:
            data = bytearray(view.buffer)
            offset = (view.header.kv_offset if where == "kv" else view.header.encoder_range.start) + 5
        data[offset] ^= 0x40
        tier.put(key, bytes(data))  # the header is intact: the gateway plans an exact hit
    finally:
        tier.close()
    answer, headers = ask(two, picture)
    assert headers["x-revisit-reuse"] == header
    assert answer == first  # never a wrong answer


def test_a_near_duplicate_of_an_image_another_gateway_saw_is_approximate(scale_out):
    from tests.e2e.test_approximate import page

    cluster, (one, two) = scale_out
    first, headers = ask(one, png_data_url(page(11)))
    key = headers["x-revisit-image-keys"]
    assert headers["x-revisit-reuse"] == "miss"
    wait_until(lambda: key in booked(two), "gateway 2 to book the entry")
    before = worker_events([two.worker.url])  # type: ignore[attr-defined]
    answer, headers = ask(two, png_data_url(page(12)))  # the same page with one number changed
    kind, _, similarity = headers["x-revisit-reuse"].partition(";similarity=")
    assert kind == "approximate" and 0.9 <= float(similarity) < 1.0  # found by gateway 2 in the shared index
    done = worker_events([two.worker.url])  # type: ignore[attr-defined]
    done.subtract(before)
    # worker B read the alias' K/V (sparse) and encoder output from the cluster: written by worker A
    assert done["approximate_executed"] == 1 and done["approximate_fallback"] == 0
    assert done["approximate_rows_reused"] > 0
    entry = wait_until(lambda: [e for e in one.admin("/admin/entries?limit=1000")["data"]
                                if e["key"] == key and e["approximate_hits"] == 1], "gateway 1 to book the hit")
    assert entry[0]["tier"] == "mooncake"
