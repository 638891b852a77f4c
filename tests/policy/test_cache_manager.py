"""The policy's decisions applied to a real tiered store (shared-memory files + LMDB)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from gateway.cache import CacheManager
from gateway.config import PolicySettings
from gateway.policy import CachePolicy
from store.config import StoreConfig
from store.tiered import TieredStore, open_tier
from tests.conftest import remove_store_memory
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
    remove_store_memory(config)


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


def test_the_books_of_a_new_gateway_hold_what_an_earlier_one_left_where_it_lies(store):
    pairs = [written(store, seed) for seed in range(4)]
    size = pairs[0][1]
    earlier = manager(store, size, dram_entries=2, lmdb_entries=4)
    for key, _ in pairs:
        earlier.insert(key, size)
    earlier.set_pinned(pairs[3][0], True)
    where = {key: store.tiers_holding(key) for key, _ in pairs}
    assert sorted(map(tuple, where.values())) == [("dram",), ("dram",), ("lmdb",), ("lmdb",)]

    restarted = manager(store, size, dram_entries=2, lmdb_entries=4)  # a new process: empty books
    assert len(restarted.policy) == 0
    done = restarted.reconcile()
    assert (done.restored, done.lost, done.stray) == (4, 0, 0)
    assert {e.key: [e.tier.value] for e in restarted.policy.entries()} == where  # nothing moved
    assert restarted.policy.get(pairs[3][0]).pinned
    tiers = restarted.policy.stats().as_dict()["tiers"]
    assert tiers["dram"]["entries"] + tiers["lmdb"]["entries"] == sum(1 for _ in store.keys()) == 4
    assert restarted.report.missing == {}
    assert restarted.reconcile() == type(done)()  # a second pass finds nothing to do


def test_reconciling_evicts_to_fit_and_drops_what_the_store_lost(store):
    pairs = [written(store, seed) for seed in range(3)]  # all in DRAM, as workers write them
    size = pairs[0][1]
    cache = manager(store, size, dram_entries=1, lmdb_entries=1)  # room for two in all
    done = cache.reconcile()
    assert done.restored == 3  # each taken in as an insert would be: the least recent one evicted to fit
    assert sum(1 for _ in store.keys()) == len(cache.policy) == 2
    assert cache.policy.stats().as_dict()["evictions"]["lmdb"]["capacity"] == 1
    assert cache.policy.stats().as_dict()["tiers"]["dram"]["entries"] == 1  # the others went down to fit
    gone = next(e.key for e in cache.policy.entries())
    store.remove(gone, force=True)  # outside the gateway
    assert cache.reconcile().lost == 1 and gone not in cache.policy


def test_a_flush_drops_entries_the_books_had_not_yet_taken_in(store):
    pairs = [written(store, seed) for seed in range(3)]
    cache = manager(store, pairs[0][1], dram_entries=3, lmdb_entries=3)
    cache.insert(*pairs[0])  # the books know one; workers wrote two more since
    cache.set_pinned(pairs[0][0], True)
    cache.flush()
    assert list(store.keys()) == [pairs[0][0]] and len(cache.policy) == 1  # the pinned one stays
    cache.flush(force=True)
    assert list(store.keys()) == [] and len(cache.policy) == 0


def test_an_entry_that_cannot_go_down_to_a_full_tier_leaves_the_books_and_the_store(tmp_path: Path):
    """LMDB's map (its disk, in effect) cannot take one more entry: the demoted one is dropped from both, rather
    than booked in LMDB while its bytes stay in DRAM, outside every capacity (what the soak's full disk found)."""
    name = f"full-{uuid.uuid4().hex[:12]}"
    config = StoreConfig(name=name, dram_dir=Path("/dev/shm") / f"revisit-store-{name}", lmdb_dir=tmp_path / "lmdb",
                         lmdb_map_size=32 << 10, lmdb_max_map_size=32 << 10, pin_host_memory=False, lmdb_sync=False)
    store = TieredStore([open_tier(tier, config) for tier in config.tiers])
    gone: list[str] = []
    try:
        keys, size = [], 0
        for seed in range(3):
            key, size = written(store, seed)
            keys.append(key)
        settings = PolicySettings(dram_capacity_bytes=2 * size, lmdb_capacity_bytes=8 * size, preset_fraction=0.0)
        cache = CacheManager(CachePolicy(settings), store, on_gone=gone.append)
        for key in keys:
            cache.insert(key, size)
        # The third entry pushed the least recently used one down; LMDB could not take it.
        assert keys[0] not in cache.policy and not store.contains(keys[0]) and gone == [keys[0]]
        assert cache.report.missing == {"demote": 1} and cache.report.dropped == {"demote": 1}
        tiers = cache.policy.stats().as_dict()["tiers"]
        assert (tiers["dram"]["entries"], tiers["lmdb"]["entries"]) == (2, 0)
        assert sorted(store.keys()) == sorted(keys[1:]) and all(store.tiers_holding(k) == ["dram"] for k in keys[1:])
    finally:
        store.close()
        remove_store_memory(config)


def test_a_restarted_gateway_books_the_store_least_recently_used_first(store):
    """Three entries in DRAM, written one after the other, where the books now have room for two: booked oldest
    first, the two most recent stay in DRAM and the oldest goes down, whatever order the store lists them in."""
    keys, size = [], 0
    for seed, when in ((0, 1000.0), (1, 2000.0), (2, 3000.0)):
        key, size = written(store, seed)
        os.utime(store.tier("dram").path / f"{key}.kv", (when, when))
        keys.append(key)
    lmdb_key, _ = written(store, 3)
    store.move(lmdb_key, src="dram", dst="lmdb")
    cache = manager(store, size, dram_entries=2, lmdb_entries=2)
    listed = [keys[2], keys[0], lmdb_key, keys[1]]
    assert cache.oldest_first(listed) == [lmdb_key, *keys]
    cache.take_in(cache.oldest_first(listed))
    where = {key: store.tiers_holding(key) for key in [*keys, lmdb_key]}
    assert where == {keys[0]: ["lmdb"], keys[1]: ["dram"], keys[2]: ["dram"], lmdb_key: ["lmdb"]}
