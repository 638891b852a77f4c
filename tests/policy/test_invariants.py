"""Randomised request sequences: the policy's invariants hold after every step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import PolicySettings
from gateway.policy import CachePolicy, EntryPinned, PresetPriors, Region, Reject, Tier
from tests.policy.helpers import ReplayStore, key, tier_bytes

KEYS = 16
OPS = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, KEYS - 1), st.integers(0, 70), st.sampled_from([None, "a", "b"])),
    st.tuples(st.just("exact"), st.integers(0, KEYS - 1)),
    st.tuples(st.just("approximate"), st.integers(0, KEYS - 1)),
    st.tuples(st.just("pin"), st.integers(0, KEYS - 1)),
    st.tuples(st.just("unpin"), st.integers(0, KEYS - 1)),
    st.tuples(st.just("remove"), st.integers(0, KEYS - 1), st.booleans()),
    # an entry found in the store where a worker or an earlier gateway left it (CacheManager.take_in)
    st.tuples(st.just("restore"), st.integers(0, KEYS - 1), st.integers(0, 70), st.sampled_from(list(Tier)),
              st.booleans()),
)
SETTINGS = st.builds(
    PolicySettings,
    dram_capacity_bytes=st.integers(0, 200),
    lmdb_capacity_bytes=st.integers(0, 300),
    preset_fraction=st.sampled_from([0.0, 0.25, 0.5]),
    max_protection_budget=st.integers(0, 3),
    preset_reuse_weight=st.sampled_from([0.0, 0.5]),
)


def step(policy: CachePolicy, op: tuple, store: ReplayStore) -> list:
    name, k = op[0], key(op[1])
    if name == "insert":
        return policy.insert(k, op[2], family=op[3])
    if name == "restore":
        if k in policy:
            return []
        store.tiers[k] = op[3]  # the store holds it already
        decisions = policy.restore(k, op[2], op[3], pinned=op[4])
        if any(isinstance(d, Reject) for d in decisions):
            del store.tiers[k]  # CacheManager removes what the books cannot take
            assert k not in policy
        return [d for d in decisions if not isinstance(d, Reject)]
    if k not in policy:
        return []
    if name == "exact":
        return policy.record_exact_hit(k)
    if name == "approximate":
        policy.record_approximate_hit(k)
    elif name == "pin":
        policy.pin(k)
    elif name == "unpin":
        policy.unpin(k)
    elif name == "remove":
        try:
            return policy.remove(k, force=op[2])
        except EntryPinned:
            assert policy.get(k).pinned and not op[2]
    return []


def check(policy: CachePolicy, store: ReplayStore, budget: int) -> None:
    s = policy.settings
    used = tier_bytes(policy)
    assert used.get(("dram", "main"), 0) <= s.main_capacity_bytes()
    assert used.get(("dram", "preset"), 0) <= s.preset_capacity_bytes()
    assert used.get(("lmdb", "main"), 0) <= s.lmdb_capacity_bytes
    stats = policy.stats()
    assert stats.tiers["dram"].bytes == used.get(("dram", "main"), 0) + used.get(("dram", "preset"), 0)
    assert stats.tiers["lmdb"].bytes == used.get(("lmdb", "main"), 0)
    assert stats.tiers["dram"].bytes <= s.dram_capacity_bytes
    assert store.tiers == {e.key: e.tier for e in policy.entries()}
    for entry in policy.entries():
        assert 0 <= entry.protection_budget <= budget
        assert entry.region is Region.MAIN or entry.tier is Tier.DRAM


@settings(max_examples=300, deadline=None)
@given(config=SETTINGS, ops=st.lists(OPS, min_size=20, max_size=150), weights=st.dictionaries(st.integers(0, KEYS - 1),
                                                                                  st.floats(0.5, 4.0)))
def test_invariants_hold_after_every_step(config, ops, weights):
    policy = CachePolicy(config, PresetPriors(keys={key(i): w for i, w in weights.items()}, families={"a": 1.5}))
    store = ReplayStore()
    for op in ops:
        pinned = {e.key: e.tier for e in policy.entries() if e.pinned}
        store.apply(step(policy, op, store))
        check(policy, store, config.max_protection_budget)
        for k, tier in pinned.items():
            # A pinned entry leaves only when removed by force; it may only move up.
            if op[0] == "remove" and key(op[1]) == k and op[2]:
                continue
            assert k in policy and (policy.get(k).tier is tier or policy.get(k).tier is Tier.DRAM)
