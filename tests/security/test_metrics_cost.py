"""/metrics is open by default and is read on the gateway's cache thread: a scrape must cost the same at any number
of cached entries, or anyone could stall the cache thread (every plan, hit and insert waits behind it) by
scraping in a loop. The policy keeps its per-tier figures as running totals (gateway/policy/policy.py), and these
tests check that a scrape walks no entry, and that the totals always equal a full recount."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cache import CacheManager
from gateway.config import PolicySettings, ReuseSettings
from gateway.metrics import build_registry, exposition
from gateway.planner import Planner
from gateway.policy import CachePolicy, PresetPriors, Region
from tests.policy.helpers import ReplayStore, key
from tests.policy.test_invariants import KEYS, OPS, SETTINGS, step

ENTRIES = 50_000


class NoWalk(dict):
    """The policy's entry map, refusing any walk over its entries (lookups by key still work)."""

    def _walked(self, *_args):
        raise AssertionError("the scrape walked the policy's entries")

    __iter__ = keys = values = items = __reversed__ = _walked  # type: ignore[assignment]


def _policy(entries: int) -> CachePolicy:
    policy = CachePolicy(PolicySettings(dram_capacity_bytes=600 * entries, lmdb_capacity_bytes=10**12,
                                        preset_fraction=0.2, preset_reuse_weight=1.0, preset_min_score=1.0))
    for i in range(entries):
        policy.insert(key(i), 1000)
        if i % 7 == 0:
            policy.record_exact_hit(key(i))
        if i % 11 == 0:
            policy.record_approximate_hit(key(i))
        if i % 13 == 0:
            policy.pin(key(i))
    return policy


def _registry(policy: CachePolicy):
    return build_registry(policy, Planner(CacheManager(policy, None), ReuseSettings()))


@pytest.fixture(scope="module")
def big() -> CachePolicy:
    return _policy(ENTRIES)


def test_a_scrape_walks_no_entry(big):
    expected = big.stats()
    assert expected.tiers["dram"].entries + expected.tiers["lmdb"].entries == ENTRIES
    assert expected.preset.entries > 0 and expected.tiers["lmdb"].entries > 0  # every region holds some
    registry = _registry(big)
    walkable = big._entries
    big._entries = NoWalk(walkable)
    try:
        text = exposition(registry).decode()
        assert big.stats() == expected  # /admin/stats reads the same running totals
    finally:
        big._entries = walkable
    assert f'revisit_cache_entries{{tier="lmdb"}} {float(expected.tiers["lmdb"].entries)}' in text
    assert f'revisit_cache_pinned_entries{{tier="dram"}} {float(expected.tiers["dram"].pinned_entries)}' in text


def test_a_scrape_costs_the_same_at_any_size(big):
    """Timed as well: the least of several scrapes at 50,000 entries against the least at 1,000."""

    def cost(policy: CachePolicy) -> float:
        registry = _registry(policy)
        runs = []
        for _ in range(30):
            started = time.perf_counter()
            exposition(registry)
            runs.append(time.perf_counter() - started)
        return min(runs)

    small, large = cost(_policy(1_000)), cost(big)
    assert large < 0.020, f"a scrape at {ENTRIES} entries took {1e3 * large:.1f} ms"
    assert large < 5 * small, f"{1e3 * large:.2f} ms at {ENTRIES} entries, {1e3 * small:.2f} ms at 1,000"


def recount(policy: CachePolicy) -> dict:
    """The per-tier figures as the policy's entries give them, walking all of them."""
    figures: dict = {}
    for entry in policy.entries():
        for name in (entry.tier.value, "preset") if entry.region is Region.PRESET else (entry.tier.value,):
            tier = figures.setdefault(name, {"entries": 0, "bytes": 0, "pinned_entries": 0, "pinned_bytes": 0})
            tier["entries"] += 1
            tier["bytes"] += entry.size_bytes
            tier["pinned_entries"] += entry.pinned
            tier["pinned_bytes"] += entry.size_bytes if entry.pinned else 0
    return figures


def totals(policy: CachePolicy) -> dict:
    stats = policy.stats()
    usage = {**stats.tiers, "preset": stats.preset}
    return {name: {"entries": u.entries, "bytes": u.bytes, "pinned_entries": u.pinned_entries,
                   "pinned_bytes": u.pinned_bytes} for name, u in usage.items() if u.entries or u.bytes}


EXTRA_OPS = st.one_of(
    OPS,
    st.tuples(st.just("flush"), st.booleans()),
    st.tuples(st.just("priors"), st.dictionaries(st.integers(0, KEYS - 1), st.floats(0.5, 4.0), max_size=4)),
    st.tuples(st.just("reload")),  # the books as shared replicas load them (SharedBooks: a snapshot)
)


@settings(max_examples=200, deadline=None)
@given(config=SETTINGS, ops=st.lists(EXTRA_OPS, min_size=20, max_size=150))
def test_the_running_totals_equal_a_recount_after_every_step(config, ops):
    policy = CachePolicy(config, PresetPriors(families={"a": 1.5}))
    store = ReplayStore()
    for op in ops:
        if op[0] == "flush":
            store.apply(policy.flush(force=op[1]))
        elif op[0] == "priors":
            policy.set_priors(PresetPriors(keys={key(i): w for i, w in op[1].items()}))
        elif op[0] == "reload":
            state = policy.state()
            policy = CachePolicy(config)
            policy.load_state(state)
        else:
            store.apply(step(policy, op, store))
        assert totals(policy) == recount(policy), op
