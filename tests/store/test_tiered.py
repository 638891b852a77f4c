"""The tiered composition: reads from the fastest valid copy, moves only on request, pins across tiers."""

from __future__ import annotations

import pytest

from store import EntryPinnedError, StoreConfig, TieredStore, UnknownTierError, open_store
from tests.store.entries import expected_sparse, key_for, make_entry

KEY = key_for("tiered")


@pytest.fixture
def tiered(store_config):
    store = open_store(store_config)
    yield store
    store.close()


def test_reads_come_from_the_fastest_tier_holding_it(tiered):
    entry = make_entry(1)[0]
    tiered.put(KEY, entry, tier="lmdb")
    with tiered.get(KEY) as view:
        assert view.tier == "lmdb"
    tiered.put(KEY, entry)  # default: the fastest tier
    assert tiered.tiers_holding(KEY) == ["dram", "lmdb"]
    with tiered.get(KEY) as view:
        assert view.tier == "dram"


def test_sparse_reads_never_move_anything(tiered):
    entry, k, v, _ = make_entry(2)
    tiered.put(KEY, entry, tier="lmdb")
    for _ in range(3):
        with tiered.get_sparse(KEY, [1, 2, 3], (2, 4)) as read:
            assert read.tier == "lmdb" and read.gather() == expected_sparse(k, v, [1, 2, 3], 2, 4)
    with tiered.get(KEY):
        pass
    assert tiered.tiers_holding(KEY) == ["lmdb"]


def test_copy_and_move_between_tiers(tiered):
    entry = make_entry(3)[0]
    assert not tiered.copy(KEY, src="lmdb", dst="dram")
    tiered.put(KEY, entry, tier="lmdb")
    assert tiered.copy(KEY, src="lmdb", dst="dram")
    assert tiered.tiers_holding(KEY) == ["dram", "lmdb"]
    tiered.remove(KEY)
    tiered.put(KEY, entry, tier="dram")
    tiered.pin(KEY)
    assert tiered.move(KEY, src="dram", dst="lmdb")  # demotion carries the pin
    assert tiered.tiers_holding(KEY) == ["lmdb"] and tiered.tier("lmdb").is_pinned(KEY)
    with tiered.get(KEY) as view:
        assert bytes(view.buffer) == entry.data
    assert not tiered.move(key_for("none"), src="dram", dst="lmdb")


def test_pins_and_remove_span_tiers(tiered):
    entry = make_entry(4)[0]
    tiered.put(KEY, entry, tier="dram")
    tiered.put(KEY, entry, tier="lmdb")
    assert tiered.tier("lmdb").pin(KEY)
    with pytest.raises(EntryPinnedError):
        tiered.remove(KEY)
    assert tiered.tiers_holding(KEY) == ["dram", "lmdb"], "a refused remove removes nothing"
    assert tiered.remove(KEY, force=True) and not tiered.contains(KEY)
    tiered.put(KEY, entry, tier="dram")
    tiered.put(KEY, entry, tier="lmdb")
    assert tiered.pin(KEY) and tiered.stats().pinned == 2
    assert tiered.unpin(KEY) and not tiered.is_pinned(KEY)


def test_stats_per_tier(tiered):
    entry = make_entry(5)[0]
    tiered.put(KEY, entry, tier="dram")
    tiered.put(key_for("b"), entry, tier="lmdb")
    tiered.put(key_for("c"), entry, tier="lmdb")
    per_tier = tiered.tier_stats()
    assert per_tier["dram"].entries == 1 and per_tier["lmdb"].entries == 2
    assert tiered.stats().bytes == 3 * len(entry.data)
    assert sorted(tiered.keys()) == sorted([KEY, key_for("b"), key_for("c")])
    assert tiered.size_of(key_for("c")) == len(entry.data)


def test_unknown_tiers_are_refused(tiered, store_config):
    with pytest.raises(UnknownTierError):
        tiered.put(KEY, make_entry(1)[0], tier="gpu")
    with pytest.raises(UnknownTierError):
        tiered.copy(KEY, src="dram", dst="ssd")
    with pytest.raises(UnknownTierError):
        TieredStore([])
    with pytest.raises(UnknownTierError):
        TieredStore([tiered.tier("dram"), tiered.tier("dram")])


def test_single_tier_configuration(store_config):
    config = StoreConfig(**{**store_config.__dict__, "tiers": ("lmdb",)})
    store = open_store(config)
    assert [t.name for t in store.tiers] == ["lmdb"]
    store.close()
