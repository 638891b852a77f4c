"""Stores on real files: DRAM in /dev/shm (a fresh directory per test), LMDB under tmp_path."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from store import KVStore, StoreConfig, open_tier
from store.tiered import TieredStore
from tests.conftest import remove_store_memory

TIER_KINDS = ("dram", "lmdb", "tiered")


@pytest.fixture
def store_config(tmp_path: Path) -> Iterator[StoreConfig]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    config = StoreConfig(name=name, dram_dir=shm / f"revisit-store-{name}", lmdb_dir=tmp_path / "lmdb",
                         lmdb_map_size=8 << 20, pin_host_memory=False, lmdb_sync=False, lmdb_grow_wait_s=1.0)
    yield config
    remove_store_memory(config)


def open_kind(kind: str, config: StoreConfig) -> KVStore:
    if kind == "tiered":
        return TieredStore([open_tier(name, config) for name in config.tiers])
    return open_tier(kind, config)


@pytest.fixture(params=TIER_KINDS)
def store(request, store_config: StoreConfig) -> Iterator[KVStore]:
    opened = open_kind(request.param, store_config)
    yield opened
    opened.close()
