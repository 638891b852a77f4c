"""The cache policy driven by synthetic request sequences."""

from __future__ import annotations

import pytest

from gateway.policy import (
    Admit,
    Demote,
    EntryPinned,
    Evict,
    InvalidEntry,
    PresetPriors,
    Promote,
    Region,
    Reject,
    Tier,
    UnknownEntry,
)
from tests.policy.helpers import ReplayStore, key, make_policy

SIZE = 10  # every entry below is 10 bytes: DRAM of 100 bytes holds 10 of them


def flood(policy, start: int, count: int, store: ReplayStore | None = None) -> None:
    """Insert ``count`` approximate-only entries, each read once sparsely."""
    for i in range(start, start + count):
        decisions = policy.insert(key(i), SIZE)
        policy.record_approximate_hit(key(i))
        if store is not None:
            store.apply(decisions)


def test_exact_entries_survive_a_flood_of_approximate_only_entries():
    policy = make_policy(max_protection_budget=4, lmdb_capacity_bytes=1000)
    store = ReplayStore()
    hot, cold = key(1), key(2)
    store.apply(policy.insert(hot, SIZE))
    store.apply(policy.insert(cold, SIZE))
    for _ in range(4):
        store.apply(policy.record_exact_hit(hot))
    flood(policy, 1000, 30, store)
    assert policy.get(hot).tier is Tier.DRAM
    assert policy.get(cold).tier is Tier.LMDB  # same age, no exact hits: demoted at the first eviction
    assert 0 < policy.stats().protections_used < 4
    assert store.tiers == {e.key: e.tier for e in policy.entries()}


def test_approximate_only_entries_leave_before_an_older_protected_entry():
    policy = make_policy()
    policy.insert(key(1), SIZE)
    policy.record_exact_hit(key(1))  # budget 1
    for i in range(2, 11):
        policy.insert(key(i), SIZE)
    decisions = policy.insert(key(11), SIZE)
    assert decisions == [Admit(key=key(11), tier=Tier.DRAM), Demote(key=key(2))]
    assert policy.get(key(1)).protection_budget == 0
    assert policy.stats().protections_used == 1


def test_stale_exact_entries_leave_once_their_budget_is_spent():
    policy = make_policy(max_protection_budget=3)
    hot = key(1)
    policy.insert(hot, SIZE)
    for _ in range(10):
        policy.record_exact_hit(hot)
    assert policy.get(hot).protection_budget == 3  # bounded: min(exact hits, max budget)
    for i in range(1000, 1100):
        policy.insert(key(i), SIZE)
        if hot not in policy or policy.get(hot).tier is not Tier.DRAM:
            break
    assert policy.get(hot).tier is Tier.LMDB
    assert policy.get(hot).protection_budget == 0
    assert policy.stats().protections_used == 3


def test_an_exact_hit_refreshes_the_budget():
    policy = make_policy(max_protection_budget=2)
    policy.insert(key(1), SIZE)
    policy.record_exact_hit(key(1))
    assert policy.get(key(1)).protection_budget == 1
    flood(policy, 100, 15)  # spends it
    assert policy.get(key(1)).protection_budget == 0
    policy.record_exact_hit(key(1))
    assert policy.get(key(1)).protection_budget == 2


def test_sparse_reads_do_not_promote_the_alias():
    policy = make_policy()
    alias = key(1)
    policy.insert(alias, SIZE)
    flood(policy, 100, 10)
    assert policy.get(alias).tier is Tier.LMDB
    before = policy.get(alias)
    for _ in range(5):
        assert policy.record_approximate_hit(alias) is None
    after = policy.get(alias)
    assert (after.tier, after.last_access, after.approximate_hits) == (Tier.LMDB, before.last_access, 5)
    assert policy.stats().hits["approximate"] == {"dram": 10, "lmdb": 5}
    assert policy.stats().decisions["promote"] == 0


def test_sparse_reads_do_not_refresh_recency_in_l2():
    policy = make_policy()
    for i in range(10):
        policy.insert(key(i), SIZE)
    for _ in range(3):
        policy.record_approximate_hit(key(0))  # the LRU entry
    assert policy.insert(key(10), SIZE)[1] == Demote(key=key(0))


def test_exact_hits_promote_from_l3_and_make_the_entry_mru():
    policy = make_policy()
    store = ReplayStore()
    for i in range(11):
        store.apply(policy.insert(key(i), SIZE))
    assert policy.get(key(0)).tier is Tier.LMDB
    decisions = policy.record_exact_hit(key(0))
    store.apply(decisions)
    assert decisions == [Promote(key=key(0)), Demote(key=key(1))]
    assert policy.get(key(0)).tier is Tier.DRAM
    assert policy.stats().hits["exact"] == {"dram": 0, "lmdb": 1}
    policy.record_exact_hit(key(2))  # now MRU with budget 1: passed over once
    store.apply(policy.insert(key(20), SIZE))
    assert store.tiers[key(3)] is Tier.LMDB and store.tiers[key(2)] is Tier.DRAM


def test_exact_hit_in_l3_stays_when_l2_is_full_of_pinned_entries():
    policy = make_policy()
    for i in range(11):
        policy.insert(key(i), SIZE)
    for i in range(1, 11):
        policy.pin(key(i))
    assert policy.record_exact_hit(key(0)) == []
    assert policy.get(key(0)).tier is Tier.LMDB


def test_l3_evicts_its_lru_entry():
    policy = make_policy(lmdb_capacity_bytes=20)
    store = ReplayStore()
    for i in range(13):
        store.apply(policy.insert(key(i), SIZE))
    assert key(0) not in policy
    assert policy.stats().evictions["lmdb"]["capacity"] == 1
    assert [e.key for e in policy.entries(tier=Tier.LMDB)] == [key(1), key(2)]


def test_entries_too_large_for_l2_go_to_l3_or_are_rejected():
    policy = make_policy(dram_capacity_bytes=50, lmdb_capacity_bytes=80)
    assert policy.insert(key(1), 60) == [Admit(key=key(1), tier=Tier.LMDB)]
    decisions = policy.insert(key(2), 81)
    assert decisions == [Reject(key=key(2), reason=decisions[0].reason)]
    assert key(2) not in policy
    assert policy.stats().decisions["reject"] == 1


def test_an_l2_victim_too_large_for_l3_is_evicted_from_l2():
    policy = make_policy(dram_capacity_bytes=100, lmdb_capacity_bytes=20)
    policy.insert(key(1), 30)
    decisions = policy.insert(key(2), 80)
    assert decisions == [Admit(key=key(2), tier=Tier.DRAM), Evict(key=key(1), tier=Tier.DRAM)]


def test_preset_entries_stay_resident_in_the_reserved_share():
    policy = make_policy(dram_capacity_bytes=100, preset_fraction=0.3)
    policy.set_priors(PresetPriors(families={"invoices": 2.0}))
    store = ReplayStore()
    store.apply(policy.insert(key(1), SIZE, family="invoices"))
    store.apply(policy.insert(key(2), SIZE, family="photos"))
    flood(policy, 100, 50, store)
    preset = policy.get(key(1))
    assert (preset.tier, preset.region) == (Tier.DRAM, Region.PRESET)
    assert key(2) not in policy or policy.get(key(2)).tier is Tier.LMDB
    stats = policy.stats()
    assert stats.decisions["reserve"] == 1
    assert (stats.preset.entries, stats.preset.bytes, stats.preset.capacity_bytes) == (1, SIZE, 30)
    assert stats.tiers["dram"].bytes <= 100 and stats.tiers["dram"].bytes - stats.preset.bytes <= 70
    assert policy.record_exact_hit(key(1)) == []  # a hit keeps it in the reserved share
    assert policy.get(key(1)).region is Region.PRESET


def test_the_reserved_share_evicts_by_weight_then_recency():
    policy = make_policy(dram_capacity_bytes=100, preset_fraction=0.2)  # preset: 20 bytes, two entries
    weights = {key(1): 3.0, key(2): 1.0, key(3): 2.0}
    policy.set_priors(PresetPriors(keys=weights))
    store = ReplayStore()
    for k in weights:
        store.apply(policy.insert(k, SIZE))
    flood(policy, 100, 30, store)
    assert [e.key for e in policy.entries() if e.region is Region.PRESET] == [key(1), key(3)]
    assert store.tiers.get(key(2), Tier.LMDB) is Tier.LMDB


def test_online_reuse_makes_an_entry_preset_eligible():
    policy = make_policy(
        dram_capacity_bytes=100, lmdb_capacity_bytes=1000, preset_fraction=0.2,
        preset_reuse_weight=0.25, preset_min_score=1.0,
    )
    policy.insert(key(1), SIZE)
    policy.insert(key(2), SIZE)
    for _ in range(4):
        policy.record_approximate_hit(key(1))  # score 1.0: eligible
    for _ in range(3):
        policy.record_approximate_hit(key(2))  # score 0.75: not
    flood(policy, 100, 20)
    assert policy.get(key(1)).region is Region.PRESET
    assert policy.get(key(2)).tier is Tier.LMDB


def test_pinned_entries_never_leave():
    policy = make_policy(lmdb_capacity_bytes=30)
    policy.insert(key(1), SIZE)
    policy.pin(key(1))
    for i in range(2, 12):
        policy.insert(key(i), SIZE)
    policy.pin(key(2))  # now in LMDB
    assert policy.get(key(2)).tier is Tier.LMDB
    flood(policy, 100, 100)
    assert (policy.get(key(1)).tier, policy.get(key(2)).tier) == (Tier.DRAM, Tier.LMDB)
    stats = policy.stats()
    assert stats.tiers["dram"].pinned_entries == 1 and stats.tiers["lmdb"].pinned_bytes == SIZE
    with pytest.raises(EntryPinned):
        policy.remove(key(1))
    policy.flush()
    assert [e.key for e in policy.entries()] == [key(1), key(2)]
    policy.unpin(key(1))
    flood(policy, 200, 10)
    assert policy.get(key(1)).tier is Tier.LMDB


def test_remove_and_flush_count_their_evictions():
    policy = make_policy()
    policy.insert(key(1), SIZE)
    policy.insert(key(2), SIZE)
    policy.pin(key(2))
    assert policy.remove(key(1)) == [Evict(key=key(1), tier=Tier.DRAM, reason="removed")]
    assert policy.flush(force=True) == [Evict(key=key(2), tier=Tier.DRAM, reason="flushed")]
    assert len(policy) == 0
    assert policy.stats().evictions["dram"] == {"capacity": 0, "removed": 1, "flushed": 1}
    assert policy.stats().tiers["dram"].pinned_bytes == 0


def test_insert_is_idempotent_and_checks_its_input():
    policy = make_policy()
    policy.insert(key(1), SIZE)
    assert policy.insert(key(1), SIZE) == []
    with pytest.raises(InvalidEntry):
        policy.insert("not-a-key", SIZE)
    with pytest.raises(InvalidEntry):
        policy.insert(key(2), -1)
    with pytest.raises(UnknownEntry):
        policy.record_exact_hit(key(3))
    with pytest.raises(KeyError):
        policy.record_approximate_hit(key(3))


def test_entries_page_in_key_order():
    policy = make_policy(dram_capacity_bytes=1000, lmdb_capacity_bytes=1000)
    for i in (5, 3, 9, 1):
        policy.insert(key(i), SIZE)
    first = policy.entries(limit=2)
    assert [e.key for e in first] == [key(1), key(3)]
    assert [e.key for e in policy.entries(after=first[-1].key, limit=2)] == [key(5), key(9)]
    first[0].pinned = True  # a copy: the policy's books do not change
    assert not policy.get(key(1)).pinned


def test_decisions_are_counted_by_kind():
    policy = make_policy(lmdb_capacity_bytes=30)
    returned = []
    for i in range(20):
        returned += policy.insert(key(i), SIZE)
    returned += policy.record_exact_hit(key(9))
    counts = policy.stats().decisions
    for kind in ("admit", "demote", "evict", "promote"):
        assert counts[kind] == sum(d.kind == kind for d in returned)
