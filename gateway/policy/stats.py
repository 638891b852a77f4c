"""A point-in-time snapshot of the policy's figures, for the admin API and /metrics."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class TierUsage:
    entries: int
    bytes: int
    capacity_bytes: int
    pinned_entries: int
    pinned_bytes: int

    def as_dict(self) -> dict:
        return {
            "entries": self.entries,
            "bytes": self.bytes,
            "capacity_bytes": self.capacity_bytes,
            "pinned_entries": self.pinned_entries,
            "pinned_bytes": self.pinned_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyStats:
    """Usage per tier, hits, decisions; every counter only grows over the policy's life.

    ``tiers["dram"]`` includes the reserved preset share, which ``preset`` reports on its own.
    ``hits[hit_type][tier]``: hit_type "exact" or "approximate", tier where the entry was
    when hit. ``decisions[kind]``: see :mod:`gateway.policy.decisions`.
    ``evictions[tier][reason]``: reason "capacity", "removed" or "flushed".
    """

    tiers: Mapping[str, TierUsage]
    preset: TierUsage
    hits: Mapping[str, Mapping[str, int]]
    decisions: Mapping[str, int]
    evictions: Mapping[str, Mapping[str, int]]
    protections_used: int

    def as_dict(self) -> dict:
        return {
            "tiers": {name: usage.as_dict() for name, usage in self.tiers.items()},
            "preset": self.preset.as_dict(),
            "hits": {kind: dict(by_tier) for kind, by_tier in self.hits.items()},
            "decisions": dict(self.decisions),
            "evictions": {tier: dict(by_reason) for tier, by_reason in self.evictions.items()},
            "protections_used": self.protections_used,
        }
