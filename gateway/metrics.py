"""Prometheus figures for one gateway app, read from the cache policy at scrape time.

Each app owns its :class:`~prometheus_client.CollectorRegistry` (never the global
default one), so several apps can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.planner import KINDS, Planner
from gateway.policy import CachePolicy

PREFIX = "revisit_cache"


class PolicyCollector(Collector):
    """Turns :meth:`CachePolicy.stats` into metric families; the same figures as GET /admin/stats."""

    def __init__(self, policy: CachePolicy):
        self._policy = policy

    def collect(self) -> Iterator[Metric]:
        stats = self._policy.stats()
        for field, help_text in (
            ("entries", "Entries per tier (dram includes the preset share)."),
            ("bytes", "Bytes per tier (dram includes the preset share)."),
            ("capacity_bytes", "Capacity per tier in bytes."),
            ("pinned_entries", "Pinned entries per tier."),
            ("pinned_bytes", "Bytes of pinned entries per tier."),
        ):
            family = GaugeMetricFamily(f"{PREFIX}_{field}", help_text, labels=["tier"])
            for tier, usage in stats.tiers.items():
                family.add_metric([tier], getattr(usage, field))
            yield family
        for field in ("entries", "bytes", "capacity_bytes"):
            yield GaugeMetricFamily(
                f"{PREFIX}_preset_{field}", f"Preset victim cache (reserved DRAM share): {field}.",
                value=getattr(stats.preset, field),
            )
        hits = CounterMetricFamily(f"{PREFIX}_hits", "Cache hits by type and the tier that served them.",
                                   labels=["type", "tier"])
        for hit_type, by_tier in stats.hits.items():
            for tier, count in by_tier.items():
                hits.add_metric([hit_type, tier], count)
        yield hits
        decisions = CounterMetricFamily(f"{PREFIX}_decisions", "Policy decisions by kind.", labels=["kind"])
        for kind, count in stats.decisions.items():
            decisions.add_metric([kind], count)
        yield decisions
        evictions = CounterMetricFamily(f"{PREFIX}_evictions", "Evictions by tier and reason.",
                                        labels=["tier", "reason"])
        for tier, by_reason in stats.evictions.items():
            for reason, count in by_reason.items():
                evictions.add_metric([tier, reason], count)
        yield evictions
        yield CounterMetricFamily(
            f"{PREFIX}_protections_used", "Times eviction spent an exact entry's protection budget.",
            value=stats.protections_used,
        )


class PlannerCollector(Collector):
    """What the planner decided per image, and the approximate-match index's size; the same figures as the
    ``plans`` and ``matching`` parts of GET /admin/stats."""

    def __init__(self, planner: Planner):
        self._planner = planner

    def collect(self) -> Iterator[Metric]:
        plans = CounterMetricFamily("revisit_plans", "Images planned, by kind (miss, exact_same_prefix, exact_moved, "
                                    "approximate), and lookups that were near misses or guard fallbacks.",
                                    labels=["kind"])
        for kind, count in sorted(planner_stats(self._planner)["plans"].items()):
            plans.add_metric([kind], count)
        yield plans
        matching = planner_stats(self._planner)["matching"]
        yield GaugeMetricFamily("revisit_match_index_entries", "Images in the approximate-match index.",
                                value=matching["indexed"])


def planner_stats(planner: Planner) -> dict:
    """The planner's counts and the match index's size (call on the cache thread, where they change)."""
    plans = {kind: 0 for kind in (*KINDS, "near_miss", "guard_fallback")}
    plans.update(planner.counts)
    matcher = planner.matcher
    return {"plans": plans, "matching": {"enabled": matcher is not None,
                                         "indexed": len(matcher.index) if matcher is not None else 0,
                                         "damaged_records": matcher.damaged_records if matcher is not None else 0}}


def build_registry(policy: CachePolicy, planner: Planner | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PolicyCollector(policy))
    if planner is not None:
        registry.register(PlannerCollector(planner))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)
