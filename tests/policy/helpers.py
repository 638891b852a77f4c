"""Shared helpers for the policy tests: keys, a small policy, a store that replays decisions."""

from __future__ import annotations

from gateway.config import PolicySettings
from gateway.policy import Admit, CachePolicy, Decision, Demote, Evict, Promote, Reject, Reserve, Tier


def key(i: int) -> str:
    return f"{i:064x}"


def make_policy(*, tiers: tuple[str, ...] = ("dram", "lmdb"), **settings) -> CachePolicy:
    defaults = {"dram_capacity_bytes": 100, "lmdb_capacity_bytes": 100, "mooncake_capacity_bytes": 100,
                "preset_fraction": 0.0}
    return CachePolicy(PolicySettings(**{**defaults, **settings}), tiers=tiers)


class ReplayStore:
    """Where each entry would be if a store applied the decisions, in order; checks each is legal."""

    def __init__(self, upper: Tier = Tier.DRAM) -> None:
        self.upper = upper
        self.tiers: dict[str, Tier] = {}

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            match d:
                case Admit():
                    assert d.key not in self.tiers, d
                    self.tiers[d.key] = d.tier
                case Reject():
                    assert d.key not in self.tiers, d
                case Promote() | Demote():
                    assert self.tiers.get(d.key) is d.source, d
                    self.tiers[d.key] = d.target
                case Reserve():
                    assert self.tiers.get(d.key) is self.upper, d
                case Evict():
                    assert self.tiers.pop(d.key, None) is d.tier, d


def tier_bytes(policy: CachePolicy) -> dict[tuple[str, str], int]:
    used: dict[tuple[str, str], int] = {}
    for entry in policy.entries():
        slot = (entry.tier.value, entry.region.value)
        used[slot] = used.get(slot, 0) + entry.size_bytes
    return used
