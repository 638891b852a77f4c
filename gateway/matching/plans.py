"""From a match to an approximate plan: the reuse set B for the chosen selector, the recompute share, the guard.

Per selector (plan.request's table), B is

    entropy_aware            the lowest-entropy ``reuse_share`` of the tokens among those that are the same or
                             similar, ranked by the larger of the two images' entropies (low in both)
    attention_only,          every same or similar token (the worker takes R out of them)
    downstream
    cacheblend, vlcache,     every token with an aligned alias token, changed ones too: these baselines are blind
    full_reuse               to the change map, as the methods they stand for (the worker takes R out of them)

For entropy_aware, attention_only and downstream, changed tokens are never in B and always in R. For every
selector but full_reuse, when the changed tokens outnumber ``recompute_share`` of the tokens the share is widened to
hold them (the same recompute budget for all), and when they outnumber ``max_changed_share`` the guard plans a miss
instead: recomputing that much costs about what a miss does.

For downstream the share is widened to hold the changed tokens and their noted ones too (plan.budget.noted_tokens:
the unchanged tokens right after and right below a changed one, which in a causal decoder took notes of its old
value): a plan never answers from stale notes to save time. Whether the wider plan still pays is the cost model's
to say; where it is what the notes added that makes it not pay, the planner's refusal says ``notes``
(``without_notes``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gateway.config import MatchSettings
from gateway.matching.align import CHANGED, reported
from gateway.matching.features import TokenFeatures
from gateway.matching.matcher import Match, compare, within_guard
from gateway.matching.moved import MovedImage
from plan import APPROXIMATE, CACHEBLEND, CHANGE_BLIND, DOWNSTREAM, ENTROPY_AWARE, FULL_PASS, FULL_REUSE, ImagePlan
from plan.budget import noted_tokens


def approximate_plan(match: Match, new_entropy: np.ndarray, *, key: str, grid: tuple[int, int], prefix_digest: str,
                     settings: MatchSettings, selector: str, layers: int | None) -> ImagePlan | None:
    """The plan for a new image matched to ``match.alias``; None when the guard says a miss is better."""
    alignment = match.alignment
    n = grid[0] * grid[1]
    changed = alignment.changes == CHANGED
    changed_share = alignment.changed_share
    if not within_guard(alignment, settings):
        return None
    aligned = alignment.alias_index >= 0
    if selector in CHANGE_BLIND:
        reuse = np.flatnonzero(aligned)
    elif selector == ENTROPY_AWARE:
        candidates = np.flatnonzero(aligned & ~changed)
        alias_entropy = match.alias_features.entropy.astype(np.float32)[alignment.alias_index[candidates]]
        risk = np.maximum(new_entropy.astype(np.float32)[candidates], alias_entropy)
        reuse = candidates[np.argsort(risk, kind="stable")[: int(settings.reuse_share * n)]]
    else:
        reuse = np.flatnonzero(aligned & ~changed)
    warmup = 1 if selector == CACHEBLEND else settings.warmup_layers
    if selector == FULL_REUSE:
        warmup, share = 0, 0.0
    else:
        share = min(1.0, max(settings.recompute_share, changed_share))
    if selector == DOWNSTREAM:
        share = min(1.0, max(share, notes_share(alignment.change_map, grid)))
    if layers is not None:
        warmup = min(warmup, max(0, layers - 1))
    # Content moved by part of a token: the alias' encoder output is of the content where it was, so the vision pass
    # runs over the whole new image (what bench/moved_quality.py measured).
    vision = settings.vision_pass if alignment.offset == (0, 0) else FULL_PASS
    return ImagePlan(key=key, kind=APPROXIMATE, tokens=n, grid=grid, prefix_digest=prefix_digest,
                     alias=match.alias, alias_grid=match.alias_features.grid, shift=alignment.shift,
                     change_map=alignment.change_map, similarity=reported(alignment.similarity),
                     reuse=tuple(int(i) for i in reuse), warmup_layers=warmup, recompute_share=round(share, 4),
                     selector=selector, vision=vision, derive=settings.derive)


def notes_share(change_map: str, grid: tuple[int, int]) -> float:
    """The share of the tokens a downstream plan must recompute: the changed ones and their noted ones."""
    tokens = grid[0] * grid[1]
    return (change_map.count("x") + len(noted_tokens(change_map, grid))) / tokens if tokens else 0.0


def without_notes(plan: ImagePlan, settings: MatchSettings) -> ImagePlan | None:
    """A downstream plan with its share as it would be without the noted tokens (the settings' share, or the changed
    share if larger), or None where the notes widened nothing: what the planner prices to tell a refusal for the
    notes' cost from one for the plan's own."""
    if plan.selector != DOWNSTREAM:
        return None
    share = round(min(1.0, max(settings.recompute_share, plan.change_map.count("x") / plan.tokens)), 4)
    return replace(plan, recompute_share=share) if share < plan.recompute_share else None


def plan_against(features: TokenFeatures, alias_features: TokenFeatures, *, alias: str, key: str,
                 settings: MatchSettings, selector: str, layers: int | None,
                 prefix_digest: str = "", moved: MovedImage | None = None) -> ImagePlan | None:
    """The plan the gateway makes for an image known to match ``alias`` (the fine stage and approximate_plan, with
    no index lookup: for benches and tests that pick the alias themselves)."""
    match = Match(alias=alias, alignment=compare(features, alias_features, settings, moved),
                  alias_features=alias_features)
    return approximate_plan(match, features.entropy, key=key, grid=features.grid, prefix_digest=prefix_digest,
                            settings=settings, selector=selector, layers=layers)
