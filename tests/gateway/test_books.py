"""The cache books follow the store, which outlives the gateway: a restarted gateway counts, protects and flushes
what an earlier run (or a worker since) left there. Real ``revisit gateway`` processes over a real store
(shared-memory files + LMDB); no SGLang worker needed, since this test writes entries as workers write them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from store.config import StoreConfig
from store.tiered import TieredStore, open_tier
from tests.conftest import free_port, remove_store_memory, start_gateway_process, terminate
from tests.store.entries import key_for, make_entry

TOKEN = "admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def store_config(tmp_path: Path) -> Iterator[StoreConfig]:
    name = f"books-{uuid.uuid4().hex[:12]}"
    config = StoreConfig(name=name, dram_dir=Path("/dev/shm") / f"revisit-store-{name}", lmdb_dir=tmp_path / "lmdb",
                         lmdb_map_size=16 << 20, pin_host_memory=False, lmdb_sync=False)
    yield config
    remove_store_memory(config)


@pytest.fixture
def worker_store(store_config: StoreConfig) -> Iterator[TieredStore]:
    """The store as a worker process opens it."""
    store = TieredStore([open_tier(tier, store_config) for tier in store_config.tiers])
    yield store
    store.close()


class Gateway:
    """``revisit gateway`` in a process of its own (LMDB opens one environment once per process)."""

    def __init__(self, store: StoreConfig) -> None:
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        env = {"REVISIT_MODEL": "revisit-tiny", "REVISIT_WORKERS": "http://127.0.0.1:9",
               "REVISIT_ADMIN_TOKEN": TOKEN, "REVISIT_BOOKS_INTERVAL_S": "0.2", "REVISIT_HEALTH_INTERVAL_S": "30",
               "REVISIT_STORE_NAME": store.name, "REVISIT_STORE_DRAM_DIR": str(store.dram_path),
               "REVISIT_STORE_LMDB_DIR": str(store.lmdb_path), "REVISIT_STORE_LMDB_MAP_SIZE": str(16 << 20),
               "REVISIT_STORE_PIN_HOST_MEMORY": "0", "REVISIT_STORE_LMDB_SYNC": "0"}
        self.process = start_gateway_process(env, port, path="/v1/models", ready=lambda r: r.status_code < 500,
                                             timeout=30)

    def stop(self) -> None:
        terminate(self.process)


def write(store: TieredStore, seed: int, tier: str | None = None) -> str:
    key = key_for(f"books-{seed}")
    store.put(key, make_entry(seed)[0], tier=tier)
    return key


def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def booked(server: Gateway) -> tuple[dict[str, int], dict[str, float]]:
    """Entries per tier as /admin/stats and as /metrics say."""
    stats = httpx.get(server.url + "/admin/stats", headers=AUTH).json()["tiers"]
    exposed = text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
    metrics = {s.labels["tier"]: s.value for f in exposed for s in f.samples if s.name == "revisit_cache_entries"}
    return {tier: usage["entries"] for tier, usage in stats.items()}, metrics


def test_a_restarted_gateway_books_what_the_store_holds_and_flushes_all_of_it(store_config, worker_store):
    left = [write(worker_store, 0), write(worker_store, 1), write(worker_store, 2, tier="lmdb")]
    first = Gateway(store_config)
    try:
        until(lambda: booked(first)[0] == {"dram": 2, "lmdb": 1}, "the books did not take in the stored entries")
        assert booked(first)[1] == {"dram": 2, "lmdb": 1}  # /metrics says the same
        since = write(worker_store, 3)  # a worker stores a miss while the gateway runs
        until(lambda: booked(first)[0]["dram"] == 3, "an entry a worker wrote was not booked")
        entries = httpx.get(first.url + "/admin/entries", headers=AUTH).json()["data"]
        assert {e["key"]: e["tier"] for e in entries} == {**{k: "dram" for k in left[:2]}, left[2]: "lmdb",
                                                          since: "dram"}  # booked where they lie: nothing moved
        httpx.post(first.url + f"/admin/entries/{since}/pin", headers=AUTH).raise_for_status()
    finally:
        first.stop()

    second = Gateway(store_config)  # a new process: its books start empty
    try:
        until(lambda: booked(second)[0] == {"dram": 3, "lmdb": 1}, "a restarted gateway did not book the store")
        assert httpx.get(second.url + f"/admin/entries/{since}", headers=AUTH).json()["pinned"]
        worker_store.remove(left[0], force=True)  # outside the gateway
        until(lambda: booked(second)[0]["dram"] == 2, "an entry the store lost stayed in the books")
        flushed = httpx.post(second.url + "/admin/flush", headers=AUTH).json()
        assert (flushed["remaining"], flushed["remaining_in_store"]) == (1, 1)  # the pinned one
        flushed = httpx.post(second.url + "/admin/flush", params={"force": "true"}, headers=AUTH).json()
        assert (flushed["remaining"], flushed["remaining_in_store"]) == (0, 0)
        assert list(worker_store.keys()) == []
    finally:
        second.stop()
