"""engine_ext.selection: the one rule that turns an approximate plan and the warmup's scores into R, B and D."""

from __future__ import annotations

import pytest
import torch

from engine_ext.selection import (
    ATTENTION,
    DEVIATION,
    attention_score,
    budget,
    candidates,
    deviation_score,
    downstream_distance,
    score_kind,
    select,
    tight,
)
from plan import APPROXIMATE, ATTENTION_ONLY, CACHEBLEND, DOWNSTREAM, ENTROPY_AWARE, FULL_REUSE, VLCACHE, ImagePlan
from plan.budget import noted_tokens
from plan.errors import PlanError

KEY, ALIAS = "a" * 64, "b" * 64


def plan(selector: str, change_map: str, reuse: list[int], *, share: float = 0.25, warmup: int = 2,
         grid: tuple[int, int] = (2, 4), shift: tuple[int, int] = (0, 0)) -> ImagePlan:
    return ImagePlan(key=KEY, kind=APPROXIMATE, tokens=grid[0] * grid[1], grid=grid, alias=ALIAS,
                     change_map=change_map, reuse=tuple(reuse), recompute_share=share, warmup_layers=warmup,
                     selector=selector, shift=shift)


def sets(selection) -> tuple[list[int], list[int], list[int]]:
    return selection.recompute.tolist(), selection.reuse.tolist(), selection.drop.tolist()


def test_entropy_aware_recomputes_changed_then_the_best_scored_outside_b_and_drops_the_rest() -> None:
    p = plan(ENTROPY_AWARE, "==x=====", [0, 7], share=0.375)  # budget 3: the changed token and two more
    score = torch.tensor([9.0, 0.0, 0.0, 5.0, 1.0, 5.0, 0.5, 9.0])  # 0 and 7 are in B: never recomputed
    assert score_kind(p) == ATTENTION and budget(p) == 3
    assert sets(select(p, score)) == ([2, 3, 5], [0, 7], [1, 4, 6])


def test_attention_only_takes_r_out_of_every_unchanged_token() -> None:
    p = plan(ATTENTION_ONLY, "=x======", [0, 2, 3, 4, 5, 6, 7])
    score = torch.arange(8, dtype=torch.float64)
    assert sets(select(p, score)) == ([1, 7], [0, 2, 3, 4, 5, 6], [])


def test_change_blind_baselines_rank_every_aligned_token_and_force_only_the_unaligned() -> None:
    # shifted down one row: the first row has no alias token
    shifted = {"grid": (2, 4), "shift": (1, 0)}
    cmap, aligned = "xxxx=x==", [4, 5, 6, 7]
    deviation = torch.tensor([0, 0, 0, 0, 1.0, 9.0, 2.0, 3.0])
    blend = plan(CACHEBLEND, cmap, aligned, share=0.625, warmup=1, **shifted)
    assert score_kind(blend) == DEVIATION
    assert sets(select(blend, deviation)) == ([0, 1, 2, 3, 5], [4, 6, 7], [])
    vl = plan(VLCACHE, cmap, aligned, share=0.625, **shifted)
    assert score_kind(vl) is None and sets(select(vl)) == ([0, 1, 2, 3, 4], [5, 6, 7], [])
    full = plan(FULL_REUSE, cmap, aligned, share=0.0, warmup=0, **shifted)
    assert sets(select(full)) == ([0, 1, 2, 3], [4, 5, 6, 7], [])


def test_downstream_recomputes_the_tokens_after_a_change_nearest_first_and_drops_nothing() -> None:
    # a 4 x 4 grid, token 5 (row 1, col 1) changed: its right neighbour (6) and the one below (9) are one step away,
    # then 7 and 10 two (7 first in reading order); tokens before it in reading order never took notes of it
    cmap = "=====x=========="
    p = plan(DOWNSTREAM, cmap, [i for i in range(16) if i != 5], share=0.25, grid=(4, 4))
    assert score_kind(p) is None and score_kind(p, question=False) is None and budget(p) == 4
    distance = downstream_distance(p)
    assert distance[:6] == [float("inf")] * 6 and distance[6] == distance[9] == 1 and distance[7] == 2
    assert sets(select(p)) == ([5, 6, 7, 9], [0, 1, 2, 3, 4, 8, 10, 11, 12, 13, 14, 15], [])
    assert sets(select(p, question=False)) == sets(select(p))  # by position: the same under chunked prefill
    assert noted_tokens(cmap, (4, 4)) == [6, 9]  # what the gateway widens rho to hold
    # at one distance a similar token first; with no changed token before them, similar tokens first
    q = plan(DOWNSTREAM, "=x==~~==", [0, 2, 3, 4, 5, 6, 7], share=0.5)
    assert downstream_distance(q)[:3] == [float("inf"), float("inf"), 1]
    assert sets(select(q)) == ([1, 2, 4, 5], [0, 3, 6, 7], [])  # 2 and 5 one away, then 4 (similar) of 3, 4, 6
    r = plan(DOWNSTREAM, "~~======", [0, 1, 2, 3, 4, 5, 6, 7], share=0.25)
    assert sets(select(r)) == ([0, 1], [2, 3, 4, 5, 6, 7], [])
    # the budget widens to hold every changed token (never reused)
    wide = plan(DOWNSTREAM, "xx=x====", [2, 4, 5, 6, 7], share=0.125)
    assert sets(select(wide)) == ([0, 1, 3], [2, 4, 5, 6, 7], [])
    with pytest.raises(PlanError):
        plan(DOWNSTREAM, "xx=x====", [0, 2], share=0.125)


def test_without_the_question_entropy_aware_drops_nothing_and_ranks_by_position() -> None:
    # chunked prefill: the question is not computed with the image, so no score says what it needs
    p = plan(ENTROPY_AWARE, "==x=~===", [0, 7], share=0.375)
    assert score_kind(p, question=False) is None and budget(p, question=False) == 3
    assert candidates(p, question=False) == [0, 1, 3, 4, 5, 6, 7]  # every token R need not take
    # R: the changed token, the similar one, then the first; B: the rest, B0's and the tokens it would drop
    assert sets(select(p, question=False)) == ([0, 2, 4], [1, 3, 5, 6, 7], [])
    with pytest.raises(ValueError):
        select(p)  # with the question, a score is needed


def test_without_the_question_attention_only_ranks_by_position_and_shifted_tokens_are_forced() -> None:
    p = plan(ATTENTION_ONLY, "=x======", [0, 2, 3, 4, 5, 6, 7])
    assert score_kind(p, question=False) is None
    assert sets(select(p, question=False)) == ([0, 1], [2, 3, 4, 5, 6, 7], [])
    # entropy-aware over a shifted alias: the row with no alias token is recomputed, not dropped
    shifted = plan(ENTROPY_AWARE, "xxxx====", [4, 5], share=0.5, shift=(1, 0))
    assert sets(select(shifted, question=False)) == ([0, 1, 2, 3], [4, 5, 6, 7], [])


def test_similar_tokens_are_recomputed_before_the_best_scored() -> None:
    p = plan(ENTROPY_AWARE, "=~=x==~=", [0], share=0.375)
    score = torch.tensor([0.0, 0.0, 9.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    assert sets(select(p, score)) == ([1, 3, 6], [0], [2, 4, 5, 7])
    blind = plan(CACHEBLEND, "=~=x==~=", list(range(8)), share=0.25, warmup=1)  # change-blind: by score only
    assert sets(select(blind, score))[0] == [2, 4]


def test_the_budget_widens_to_hold_every_changed_token_unless_the_question_ranks_them() -> None:
    blind = plan(CACHEBLEND, "xxx=x===", list(range(8)), share=0.1, warmup=1)  # change-blind: nothing forced
    assert budget(blind) == 1
    p = plan(ENTROPY_AWARE, "xxx=x===", [5], share=0.1)
    assert budget(p, question=False) == 4  # nothing to rank the changed tokens by: every one recomputed
    assert sets(select(p, question=False)) == ([0, 1, 2, 4], [3, 5, 6, 7], [])


def test_a_tight_budget_recomputes_the_changed_tokens_the_question_needs_and_drops_the_others() -> None:
    p = plan(ENTROPY_AWARE, "xxx=x===", [5], share=0.1)  # one token for four changed ones
    assert tight(p) and budget(p) == 1
    assert sets(select(p, torch.tensor([0, 0, 5.0, 0, 9, 0, 0, 0]))) == ([4], [5], [0, 1, 2, 3, 6, 7])
    assert sets(select(p, torch.zeros(8))) == ([0], [5], [1, 2, 3, 4, 6, 7])  # ties: the earliest
    # attention_only: every unchanged token is still reused (similar ones too, with no budget left for them); the
    # changed ones left out are dropped, never reused (their alias K/V are stale)
    a = plan(ATTENTION_ONLY, "xxx=x~==", [3, 5, 6, 7], share=0.25)
    assert sets(select(a, torch.tensor([0, 3, 5.0, 0, 9, 0, 0, 0]))) == ([2, 4], [3, 5, 6, 7], [0, 1])
    assert not tight(plan(ATTENTION_ONLY, "xxx=x~==", [3, 5, 6, 7], share=0.5))  # four tokens: room for all
    with pytest.raises(ValueError, match="score"):
        select(p)


def test_ties_rank_the_earlier_token_first_and_no_warmup_ranks_by_position() -> None:
    p = plan(ATTENTION_ONLY, "========", list(range(8)))
    assert sets(select(p, torch.ones(8)))[0] == [0, 1]
    cold = plan(ATTENTION_ONLY, "========", list(range(8)), warmup=0)
    assert score_kind(cold) is None and sets(select(cold))[0] == [0, 1]


def test_a_missing_or_misshapen_score_is_refused() -> None:
    p = plan(ENTROPY_AWARE, "========", [0])
    with pytest.raises(ValueError, match="score per token"):
        select(p)
    with pytest.raises(ValueError, match="score per token"):
        select(p, torch.zeros(3))


def test_attention_score_weighs_attention_by_value_norm_so_sinks_do_not_win() -> None:
    # token 0 draws most of the attention but passes on almost nothing (a sink); token 2 is the one read
    probs = torch.tensor([[[0.7, 0.1, 0.2]], [[0.8, 0.1, 0.1]]])  # (heads 2, question rows 1, tokens 3)
    values = torch.tensor([[[0.01, 0.0]], [[1.0, 0.0]], [[0.0, 3.0]]])  # (tokens, kv_heads 1, head_dim 2)
    score = attention_score(probs, values)
    assert int(score.argmax()) == 2 and int(probs.sum((0, 1)).argmax()) == 0
    assert torch.allclose(score, torch.tensor([0.015, 0.2, 0.9], dtype=torch.float64))


def test_deviation_is_the_squared_distance_of_k_and_v() -> None:
    k, v = torch.zeros(2, 2, 3), torch.zeros(2, 2, 3)
    alias_k, alias_v = k.clone(), v.clone()
    alias_k[1, 0, 0], alias_v[1, 1, 2] = 2.0, 1.0
    assert deviation_score(k, v, alias_k, alias_v).tolist() == [0.0, 5.0]
