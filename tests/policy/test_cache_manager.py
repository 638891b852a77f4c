"""The policy's decisions applied to a real tiered store (shared-memory files + LMDB)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from gateway.cache import CacheManager
from gateway.config import PolicySettings
from gateway.policy import CachePolicy
from store.config import StoreConfig
from store.tiered import TieredStore, open_tier
from tests.store.entries import key_for, make_entry


@pytest.fixture
def store(tmp_path: Path):
    name = f"cache-{uuid.uuid4().hex[:12]}"
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    config = StoreConfig(name=name, dram_dir=shm / f"revisit-store-{name}", lmdb_dir=tmp_path / "lmdb",
                         lmdb_map_size=8 << 20, pin_host_memory=False, lmdb_sync=False)
    tiered = TieredStore([open_tier(tier, config) for tier in config.tiers])
    yield tiered
    tiered.close()
    shutil.rmtree(config.dram_path, ignore_errors=True)


def written(store: TieredStore, seed: int) -> tuple[str, int]:
    """What a worker does after a miss: write the entry to the fastest tier."""
    entry = make_entry(seed)[0]
    key = key_for(seed)
    store.put(key, entry)
    return key, len(entry.data)


def manager(store: TieredStore, entry_size: int, *, dram_entries: int, lmdb_entries: int) -> CacheManager:
    settings = PolicySettings(dram_capacity_bytes=dram_entries * entry_size,
                              lmdb_capacity_bytes=lmdb_entries * entry_size, preset_fraction=0.0)
    return CacheManager(CachePolicy(settings), store)


def test_demotion_promotion_and_eviction_move_the_bytes(store):
    keys, size = [], 0
    for seed in range(3):
        key, size = written(store, seed)
        keys.append(key)
    cache = manager(store, size, dram_entries=2, lmdb_entries=1)
    for key in keys:
        cache.insert(key, size)
    # Three entries, room for two in DRAM: the least recently used one went down to LMDB.
    assert store.tiers_holding(keys[0]) == ["lmdb"]
    assert store.tiers_holding(keys[1]) == ["dram"] and store.tiers_holding(keys[2]) == ["dram"]
    assert store.get(keys[0]) is not None  # and still reads, verified, from LMDB

    # An exact hit brings it back up, pushing the next LRU entry down.
    cache.record_exact_hit(keys[0])
    assert store.tiers_holding(keys[0]) == ["dram"]
    assert store.tiers_holding(keys[1]) == ["lmdb"]

    # A fourth entry: DRAM demotes again and LMDB (room for one) must evict.
    key, _ = written(store, 3)
    cache.insert(key, size)
    held = {k: store.tiers_holding(k) for k in [*keys, key]}
    assert sum(1 for tiers in held.values() if tiers == ["dram"]) == 2
    assert sum(1 for tiers in held.values() if tiers == ["lmdb"]) == 1
    assert sum(1 for tiers in held.values() if not tiers) == 1
    assert cache.report.missing == {}
    assert cache.policy.stats().as_dict()["tiers"]["lmdb"]["entries"] == 1


def test_remove_flush_and_pins_reach_the_store(store):
    pairs = [written(store, seed) for seed in range(3)]
    cache = manager(store, pairs[0][1], dram_entries=3, lmdb_entries=3)
    for key, size in pairs:
        cache.insert(key, size)
    cache.remove(pairs[0][0])
    assert not store.contains(pairs[0][0])
    cache.set_pinned(pairs[1][0], True)
    assert store.is_pinned(pairs[1][0])
    cache.flush()
    assert store.contains(pairs[1][0]) and not store.contains(pairs[2][0])  # the pinned one stays
    cache.flush(force=True)
    assert not store.contains(pairs[1][0])


def test_a_decision_about_bytes_the_store_lacks_is_counted_not_fatal(store):
    key, size = written(store, 0)
    cache = manager(store, size, dram_entries=1, lmdb_entries=1)
    cache.insert(key, size)
    store.remove(key)  # e.g. damaged and dropped
    ghost, _ = written(store, 1)
    store.remove(ghost)
    cache.insert(ghost, size)  # demotes `key`, which the store no longer has
    assert cache.report.missing["demote"] == 1
