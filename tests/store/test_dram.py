"""The DRAM tier's files: temp-file hygiene, capacity accounting, and mappings that outlive their file."""

from __future__ import annotations

import os
import time

import pytest

from store import DramTier, StoreError, StoreFullError
from store.dram import TEMP_PREFIX
from tests.store.entries import key_for, make_entry


def test_stale_temps_are_removed_and_live_ones_kept(store_config):
    path = store_config.dram_path
    path.mkdir(parents=True)
    dead = path / f"{TEMP_PREFIX}999999999.{key_for(1)}.ab"  # no such pid
    live = path / f"{TEMP_PREFIX}{os.getpid()}.{key_for(2)}.cd"
    old = path / f"{TEMP_PREFIX}{os.getpid()}.{key_for(3)}.ef"
    for temp in (dead, live, old):
        temp.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    tier = DramTier(path, pin_host_memory=False)
    assert tier.removed_stale_temps == 2
    assert live.exists() and not dead.exists() and not old.exists()
    assert list(tier.keys()) == [] and tier.stats().entries == 0


def test_capacity_is_reported_and_enforced_without_eviction(store_config):
    entry = make_entry(1)[0]
    tier = DramTier(store_config.dram_path, capacity_bytes=2 * len(entry.data) + 10, pin_host_memory=False)
    tier.put(key_for(1), entry)
    tier.put(key_for(2), entry)
    tier.put(key_for(2), entry)  # replacing does not count twice
    with pytest.raises(StoreFullError):
        tier.put(key_for(3), entry)
    stats = tier.stats()
    assert (stats.entries, stats.bytes, stats.capacity_bytes) == (2, 2 * len(entry.data), 2 * len(entry.data) + 10)
    assert not [n for n in os.listdir(tier.path) if n.startswith(TEMP_PREFIX)]


def test_cpu_host_does_not_page_lock(store_config):
    torch = pytest.importorskip("torch")
    tier = DramTier(store_config.dram_path, pin_host_memory=True)
    assert tier.page_locks == torch.cuda.is_available()
    tier.put(key_for(1), make_entry(1)[0])
    with tier.get(key_for(1)) as view:
        assert view.header.num_layers == 4


def test_mapping_survives_removal_by_another_store(store_config):
    entry = make_entry(1)[0]
    writer = DramTier(store_config.dram_path, pin_host_memory=False)
    reader = DramTier(store_config.dram_path, pin_host_memory=False)
    writer.put(key_for(1), entry)
    view = reader.get(key_for(1))
    array = view.kv_array()
    writer.remove(key_for(1))
    assert bytes(view.buffer) == entry.data
    view.close()  # the numpy array still refers to the mapping: it stays mapped until the array goes
    assert array.shape == (64, 4, 2, 2, 16)
    del array


def test_unwritable_directory_is_a_store_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError):
        DramTier(blocker / "dram")


def test_reads_reuse_their_mapping_and_see_a_replacement_made_elsewhere(store_config):
    first, second = make_entry(1)[0], make_entry(2)[0]
    writer = DramTier(store_config.dram_path, pin_host_memory=False)
    reader = DramTier(store_config.dram_path, pin_host_memory=False)
    writer.put(key_for(1), first)
    for _ in range(3):
        with reader.get(key_for(1)) as view:
            assert view.header.model_id == "seed-1"
    assert reader.mapping_cache_stats == {"entries": 1, "bytes": len(first.data), "hits": 2, "misses": 1}
    writer.put(key_for(1), second)  # a new file renamed over the name: the cached mapping is of the old one
    with reader.get(key_for(1)) as view:
        assert view.header.model_id == "seed-2" and bytes(view.buffer) == second.data
    assert reader.mapping_cache_stats["misses"] == 2 and reader.mapping_cache_stats["entries"] == 1


def test_a_removal_elsewhere_unmaps_on_the_next_sweep(store_config):
    entry = make_entry(1)[0]
    writer = DramTier(store_config.dram_path, pin_host_memory=False)
    reader = DramTier(store_config.dram_path, pin_host_memory=False, sweep_interval_s=0.0)
    writer.put(key_for(1), entry)
    writer.put(key_for(2), entry)
    for key in (key_for(1), key_for(2)):
        reader.get(key).close()
    assert reader.mapping_cache_stats["entries"] == 2
    writer.remove(key_for(1))
    with reader.get(key_for(2)):  # any read sweeps: the removed file's memory is no longer held here
        assert reader.mapping_cache_stats["entries"] == 1
    assert reader.get(key_for(1)) is None


def test_mapping_cache_is_bounded_and_handles_outlive_eviction(store_config):
    entries = [make_entry(seed)[0] for seed in range(4)]
    size = len(entries[0].data)
    tier = DramTier(store_config.dram_path, pin_host_memory=False, mapping_cache_bytes=2 * size + size // 2)
    for seed, entry in enumerate(entries):
        tier.put(key_for(seed), entry)
    held = tier.get(key_for(0))
    for seed in range(1, 4):
        tier.get(key_for(seed)).close()
    stats = tier.mapping_cache_stats
    assert stats["entries"] == 2 and stats["bytes"] == 2 * size
    assert bytes(held.buffer) == entries[0].data  # evicted from the cache while in use: still mapped
    held.close()
    uncached = DramTier(store_config.dram_path, pin_host_memory=False, mapping_cache_bytes=0)
    with uncached.get(key_for(3)) as view:
        assert bytes(view.buffer) == entries[3].data
    assert uncached.mapping_cache_stats["entries"] == 0


def test_damage_under_a_cached_mapping_reads_absent(store_config):
    entry = make_entry(1)[0]
    tier = DramTier(store_config.dram_path, pin_host_memory=False)
    tier.put(key_for(1), entry)
    tier.get(key_for(1)).close()
    with open(tier.path / f"{key_for(1)}.kv", "r+b") as f:  # in place: same file, the cached mapping sees it
        f.seek(entry.header.kv_range.start + 5)
        f.write(b"\xff")
    assert tier.get(key_for(1)) is None and tier.stats().damaged_reads == 1
    assert tier.mapping_cache_stats["hits"] == 1
