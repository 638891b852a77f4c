"""How many of an approximate plan's image tokens the selection recomputes, and which it must: the part of
engine_ext.selection (the one rule that turns a plan and the warmup's scores into R, B and D; its docstring says
why) that needs no scores, shared with the gateway's cost model (gateway/costs.py), which counts a plan's work
from the plan alone."""

from __future__ import annotations

import math

from plan.request import ATTENTION_ONLY, CACHEBLEND, CHANGE_BLIND, CHANGED, ENTROPY_AWARE, ImagePlan

ATTENTION, DEVIATION = "attention", "deviation"
_SCORES = {ENTROPY_AWARE: ATTENTION, ATTENTION_ONLY: ATTENTION, CACHEBLEND: DEVIATION}


def score_kind(plan: ImagePlan, *, question: bool = True) -> str | None:
    """What the plan's selector ranks by, when it needs something measured: ATTENTION (in the warmup layers),
    DEVIATION (layer 0's K/V against the alias'), or None (position, or nothing to rank). ``question``: whether
    the question's rows are computed with the image's (engine_ext.selection)."""
    kind = _SCORES.get(plan.selector)
    if kind == ATTENTION and (plan.warmup_layers == 0 or not question):
        return None  # no warmup to measure in, or no question to measure with: ranked by position
    return kind


def changed_tokens(plan: ImagePlan) -> list[int]:
    return [i for i, mark in enumerate(plan.change_map) if mark == CHANGED]


def noted_tokens(change_map: str, grid: tuple[int, int]) -> list[int]:
    """The unchanged tokens right after or right below a changed one (the downstream selector's nearest, engine_ext.
    selection): in a causal decoder the first to have taken notes of the changed token's old value, so what a plan
    by that selector must recompute besides the changed tokens (the gateway widens rho to hold them)."""
    rows, cols = grid
    out = set()
    for token, mark in enumerate(change_map):
        if mark == CHANGED:
            row, col = divmod(token, cols)
            for neighbour, inside in ((token + 1, col + 1 < cols), (token + cols, row + 1 < rows)):
                if inside and change_map[neighbour] != CHANGED:
                    out.add(neighbour)
    return sorted(out)


def drops(plan: ImagePlan, question: bool) -> bool:
    """Whether the selection drops tokens: entropy_aware's, with the question to say which it does not need."""
    return plan.selector == ENTROPY_AWARE and question


def forced(plan: ImagePlan, *, question: bool = True) -> list[int]:
    """The tokens R takes whatever the scores: the changed ones, or for the change-blind selectors the ones with no
    alias token (nothing to reuse); both for entropy_aware without the question (it drops nothing then)."""
    unaligned = [i for i in range(plan.tokens) if plan.alias_token(i) is None]
    if plan.selector in CHANGE_BLIND:
        return unaligned
    if plan.selector == ENTROPY_AWARE and not question:
        return sorted(set(changed_tokens(plan)) | set(unaligned))
    return changed_tokens(plan)


def budget(plan: ImagePlan, *, question: bool = True) -> int:
    """How many tokens R holds: ceil(rho * n), never fewer than the forced ones unless ``tight``."""
    share = min(plan.tokens, math.ceil(plan.recompute_share * plan.tokens - 1e-6))
    return share if tight(plan, question=question) else max(len(forced(plan, question=question)), share)


def tight(plan: ImagePlan, *, question: bool = True) -> bool:
    """Whether the plan's budget is below its changed tokens and its selector ranks them by the question
    (engine_ext.selection): R then takes the changed tokens the question needs most, and drops the others."""
    return (plan.selector in (ENTROPY_AWARE, ATTENTION_ONLY) and score_kind(plan, question=question) is not None
            and math.ceil(plan.recompute_share * plan.tokens - 1e-6) < len(changed_tokens(plan)))
