"""bench/matching.py's ``tune`` section: the match threshold and the guard (max_changed_share) chosen on one half of
the labelled pairs (every other pair of each family), reported on the other half.

    .venv/bin/python bench/matching.py --sections tune
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from bench.matching import _label, extract, key, moved_of, off_grid, planned
from gateway.config import MatchSettings
from gateway.matching.features import Extractor
from gateway.matching.matcher import Matcher
from offline.near_duplicates import FAMILIES, Pair

TUNE_MATCH_THRESHOLDS = (0.8, 0.85, 0.875, 0.9, 0.925, 0.95)
TUNE_MAX_CHANGED_SHARES = (0.25, 0.3, 0.35, 0.4, 0.45, 0.5)


def halves(pairs: list[Pair]) -> list[str]:
    """Which half of the labelled set each pair is in, "tune" or "eval": alternately within each family, in the
    set's order (so each half holds about half of every family, the same every run)."""
    seen: defaultdict[str, int] = defaultdict(int)
    out = []
    for pair in pairs:
        out.append("tune" if seen[pair.family] % 2 == 0 else "eval")
        seen[pair.family] += 1
    return out


def in_reach(pair: Pair, settings: MatchSettings) -> bool:
    """Whether a plan may be made for the pair at all: its content moved by whole tokens, or off the grid within
    the bounds planned (max_subtoken_px_y and _x), or the pair does not say how it moved."""
    off = off_grid(pair)
    return off is None or off == (0, 0) or settings.plans_offset(off)


def tune(extractor: Extractor, settings: MatchSettings, pairs: list[Pair]) -> dict[str, Any]:
    """The match threshold and the guard (max_changed_share) chosen on one half of the labelled set (the most
    near-duplicates in reach matched with no unrelated pair matched; on a tie the current values, else the stricter
    ones), and both
    the chosen and the current values reported on the other half, per family."""
    features = [(extract(extractor, p.a), extract(extractor, p.b)) for p in pairs]
    moved = [moved_of(extractor, settings, p.b) for p in pairs]  # its pixels and realignments kept across settings
    half_of = halves(pairs)

    def outcome(candidate: MatchSettings, half: str) -> dict[str, list[int]]:
        per: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # family -> [matched, pairs]
        for i, pair in enumerate(pairs):
            if half_of[i] != half or (_label(pair.family) and not in_reach(pair, candidate)):
                continue
            matcher = Matcher(candidate, scope="bench", features=None)
            matcher.add(key(("a", i)), "ns", features[i][0])
            _, plan, _ = planned(matcher, candidate, key(("b", i)), features[i][1], moved[i])
            per[pair.family][0] += plan is not None
            per[pair.family][1] += 1
        return dict(per)

    def score(per: dict[str, list[int]]) -> tuple[int, int]:
        near = sum(m for family, (m, _) in per.items() if _label(family))
        unrelated = sum(m for family, (m, _) in per.items() if _label(family) is False)
        return near, unrelated

    grid = []
    for threshold in TUNE_MATCH_THRESHOLDS:
        for share in TUNE_MAX_CHANGED_SHARES:
            candidate = dataclasses.replace(settings, match_threshold=threshold, max_changed_share=share)
            near, unrelated = score(outcome(candidate, "tune"))
            grid.append({"match_threshold": threshold, "max_changed_share": share, "near_matched": near,
                         "unrelated_matched": unrelated})
    clean = [row for row in grid if row["unrelated_matched"] == 0]
    most = max(row["near_matched"] for row in clean)
    tied = [row for row in clean if row["near_matched"] == most]
    # Values move only on evidence: the current ones stay where they are among the best, else the strictest best.
    best = next((row for row in tied if (row["match_threshold"], row["max_changed_share"]) ==
                 (settings.match_threshold, settings.max_changed_share)), None) or \
        max(tied, key=lambda r: (r["match_threshold"], -r["max_changed_share"]))
    chosen = dataclasses.replace(settings, match_threshold=best["match_threshold"],
                                 max_changed_share=best["max_changed_share"])
    return {"halves": {half: half_of.count(half) for half in ("tune", "eval")}, "grid": grid, "chosen": best,
            "current": {"match_threshold": settings.match_threshold,
                        "max_changed_share": settings.max_changed_share},
            "eval_chosen": outcome(chosen, "eval"), "eval_current": outcome(settings, "eval")}


def print_tune(result: dict[str, Any]) -> None:
    chosen, current = result["chosen"], result["current"]
    print(f"  halves: {result['halves']}; grid: match threshold x guard, near-duplicates in reach matched on the "
          "tune half (unrelated matched)")
    for row in result["grid"]:
        if row["max_changed_share"] == TUNE_MAX_CHANGED_SHARES[0]:
            print(f"    {row['match_threshold']:6.3f}:", end="")
        print(f" {row['max_changed_share']:.2f} {row['near_matched']:3d} ({row['unrelated_matched']})", end="")
        if row["max_changed_share"] == TUNE_MAX_CHANGED_SHARES[-1]:
            print()
    print(f"  chosen on the tune half: match threshold {chosen['match_threshold']}, guard "
          f"{chosen['max_changed_share']} (current: {current['match_threshold']}, {current['max_changed_share']})")
    print(f"  evaluation half, matched / pairs (near-duplicates in reach: content moved by whole tokens or off "
          f"the grid within the bounds planned):\n  {'family':22s} {'chosen':>9s} {'current':>9s}")
    for family in FAMILIES:
        a, b = result["eval_chosen"].get(family), result["eval_current"].get(family)
        if a or b:
            print(f"  {family:22s} {a[0] if a else 0:4d} / {a[1] if a else 0:<3d} {b[0] if b else 0:4d} / "
                  f"{b[1] if b else 0:<3d}")
