"""The books over other tier pairs than DRAM and LMDB: the shared mooncake tier below DRAM, or alone (scale-out)."""

from __future__ import annotations

import pytest

from gateway.config import PolicySettings
from gateway.policy import Admit, CachePolicy, Demote, Evict, InvalidEntry, Promote, Region, Reserve, Tier
from tests.policy.helpers import ReplayStore, key, make_policy

SIZE = 10


def test_mooncake_below_dram_takes_the_victims_and_gives_back_the_exact_hits():
    policy = make_policy(tiers=("dram", "mooncake"), dram_capacity_bytes=20, mooncake_capacity_bytes=30)
    store = ReplayStore()
    for i in range(3):
        store.apply(policy.insert(key(i), SIZE))
    assert policy.get(key(0)).tier is Tier.MOONCAKE
    assert Promote(key=key(0), source=Tier.MOONCAKE, target=Tier.DRAM) in (hit := policy.record_exact_hit(key(0)))
    store.apply(hit)
    assert Demote(key=key(1), source=Tier.DRAM, target=Tier.MOONCAKE) in hit
    for i in range(3, 7):
        store.apply(policy.insert(key(i), SIZE))
    stats = policy.stats()
    assert set(stats.tiers) == {"dram", "mooncake"} and "lmdb" not in stats.hits["exact"]
    assert stats.tiers["dram"].bytes <= 20 and stats.tiers["mooncake"].bytes <= 30
    assert stats.evictions["mooncake"]["capacity"] == 2 and len(policy) == 5  # 7 entries, room for 5
    assert store.tiers == {e.key: e.tier for e in policy.entries()}


def test_the_shared_tier_alone_keeps_exact_priority_and_the_preset_share():
    policy = make_policy(tiers=("mooncake",), mooncake_capacity_bytes=100, preset_fraction=0.2,
                         preset_min_score=0.5, preset_reuse_weight=0.5)
    store = ReplayStore(upper=Tier.MOONCAKE)
    hot = key(1)
    store.apply(policy.insert(hot, SIZE))
    store.apply(policy.record_exact_hit(hot))
    evicted = []
    for i in range(100, 120):
        decisions = policy.insert(key(i), SIZE)
        store.apply(decisions)
        evicted += [d for d in decisions if isinstance(d, Evict)]
        assert not any(isinstance(d, Demote | Promote) for d in decisions), "one tier: nothing moves"
    assert policy.get(hot).tier is Tier.MOONCAKE
    assert policy.get(hot).region is Region.PRESET  # kept in the reserved share, not evicted
    assert evicted and all(d.tier is Tier.MOONCAKE and d.reason == "capacity" for d in evicted)
    stats = policy.stats()
    assert list(stats.tiers) == ["mooncake"] and stats.tiers["mooncake"].bytes <= 100
    assert stats.decisions["reserve"] >= 1 and stats.preset.entries == 1
    assert store.tiers == {e.key: e.tier for e in policy.entries()}


def test_one_tier_rejects_what_cannot_fit_and_restores_where_it_is():
    policy = make_policy(tiers=("mooncake",), mooncake_capacity_bytes=15)
    assert policy.insert(key(1), 20)[0].kind == "reject"
    assert policy.restore(key(2), SIZE, Tier.MOONCAKE) == []
    assert policy.get(key(2)).tier is Tier.MOONCAKE
    # an entry found in a tier the books do not manage has nowhere to go with one tier
    assert policy.restore(key(3), SIZE, Tier.LMDB)[0].kind == "reject"


def test_the_admit_names_the_upper_tier():
    policy = make_policy(tiers=("mooncake",))
    assert policy.insert(key(1), SIZE) == [Admit(key=key(1), tier=Tier.MOONCAKE)]
    assert Reserve.kind == "reserve"


@pytest.mark.parametrize("tiers", [(), ("dram", "lmdb", "mooncake"), ("dram", "dram"), ("gpu",)])
def test_the_books_refuse_tier_lists_they_cannot_manage(tiers):
    with pytest.raises((InvalidEntry, ValueError)):
        CachePolicy(PolicySettings(), tiers=tiers)
