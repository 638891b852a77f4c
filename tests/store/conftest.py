"""Stores on real files and a real cluster: DRAM in /dev/shm (a fresh directory per test), LMDB under tmp_path, the
mooncake tier in the session's Mooncake cluster (a fresh store name per test, so no test sees another's entries)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from store import KVStore, StoreConfig, open_tier
from store.tiered import TieredStore
from tests.conftest import remove_store_memory

TIER_KINDS = ("dram", "lmdb", "mooncake", "tiered", "tiered-shared")


@pytest.fixture
def store_config(tmp_path: Path, mooncake_cluster) -> Iterator[StoreConfig]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    config = StoreConfig(name=name, dram_dir=shm / f"revisit-store-{name}", lmdb_dir=tmp_path / "lmdb",
                         lmdb_map_size=8 << 20, pin_host_memory=False, lmdb_sync=False, lmdb_grow_wait_s=1.0,
                         mooncake_master=mooncake_cluster.master_address,
                         mooncake_metadata_server=mooncake_cluster.metadata_server,
                         mooncake_admin_url=mooncake_cluster.admin_url)
    yield config
    remove_store_memory(config)


def open_kind(kind: str, config: StoreConfig) -> KVStore:
    if kind == "tiered":
        return TieredStore([open_tier(name, config) for name in config.tiers])
    if kind == "tiered-shared":  # a host's DRAM in front of the shared tier
        return TieredStore([open_tier("dram", config), open_tier("mooncake", config)])
    return open_tier(kind, config)


@pytest.fixture(params=TIER_KINDS)
def store(request, store_config: StoreConfig) -> Iterator[KVStore]:
    opened = open_kind(request.param, store_config)
    yield opened
    opened.close()
