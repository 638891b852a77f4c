"""Which image tokens an approximate plan recomputes (R), reuses (B) and drops (D): one rule for the workers and
the reference, so that the two can differ only in what they measure, never in what they decide.

The gateway's plan (plan.request.ImagePlan, kind approximate) fixes the candidates B0 (``plan.reuse``), the
warmup depth W and the recompute share rho; this module turns them and the scores measured in the warmup into the
three sets. Per selector (the plan's ``selector``):

    entropy_aware   R = the changed tokens, then the similar tokens outside B0, then the tokens outside B0 that
                    score highest by warmup attention, up to the budget; B = B0 (the gateway chose it by entropy);
                    D = the rest
    attention_only  R = the changed tokens, then the similar tokens, then the tokens of B0 (every unchanged token)
                    that score highest by warmup attention; B = B0 without them; nothing dropped (entropy_aware
                    without the entropy)
    downstream      R = the changed tokens, then the tokens after a changed token in reading order, nearest to one
                    in the grid first (|rows| + |columns| apart; at one distance similar tokens first, then reading
                    order), then the rest (similar first), up to the budget; B = B0 (every unchanged token) without
                    them; nothing dropped. A causal decoder's token may take notes of any token before it, and a
                    note of a changed token's old value is stale in the alias' K/V: these are the tokens most likely
                    to hold such notes (a changed token's neighbours to the right and below, its ``noted`` tokens,
                    come first; the gateway widens rho to hold them). Ranked by position: it needs no measurement,
                    so it selects the same with or without the question (chunked prefill)
    cacheblend      change-blind, as CacheBlend: B0 is every aligned token, changed ones too; R = the tokens with
                    no alias token, then those whose layer-0 K/V moved furthest from the alias' (W = 1); B = B0
                    without them
    vlcache         change-blind, as VLCache: R = the tokens with no alias token, then the image's first tokens
    full_reuse      change-blind, nothing ranked: R = the tokens with no alias token; B = every other token

Without the question (``question=False``: under chunked prefill, where the image's rows and its question are not
all in one extend, so no question row is there when layer W is reached) nothing says which tokens the question
needs: entropy_aware drops nothing and selects as attention_only does (R = the changed tokens and those with no
alias token, then the similar ones, then the first ones; B = every other token), attention_only ranks by position,
as with W = 0, and the deviation score needs no question. Every extend of the image then decides the same sets.
Measured on the oracle reader (bench/approximate_quality.py --chunked, 40 pairs): entropy_aware ranked by position
and dropping the rest answered 32.5% of the questions on unchanged fields (75% with the question), selecting as
attention_only 100%, a full prefill 100%; changed fields 100% in each.

The budget is ceil(rho * n) tokens, widened to hold every token R must take (the gateway widens rho to the changed
share the same way, and its guard plans a miss when that would be too many). A budget below the changed tokens
(``tight``: a plan whose rho is below its changed share, for the question-ranked selectors with the question) is
not widened: R takes the changed tokens that score highest by warmup attention, up to the budget, and the other
changed tokens are dropped (their alias K/V are stale, so they are never reused); everything else is as above
with no budget left. Change-blind selectors need no such rule: their budget never had to hold the changed tokens.
Scores within 1e-5 of the largest of each other are ties, and ties rank the earlier token first.
Similar tokens ("~": their pixels differ, their descriptors nearly agree) come before the scored ones: measured on
the reading model, 8 of 55 tokens of changed fields were similar, not changed (a glyph redrawn differs little in a
coarse descriptor), and reusing them answered with the old value.

Scores (both implementations compute them the same way, each over its own tensors):

- :func:`attention_score`: the attention a token receives from the question (the prompt's rows after the image),
  weighted by the norm of the token's value vector. Attention sinks (blank margins and other tokens that draw
  attention from every query) carry small values: weighted by what they pass on rather than by how much they are
  looked at, they do not win. Summed over the warmup layers and the heads, averaged over the question's rows.
- :func:`deviation_score`: CacheBlend's KV deviation, |k - k_alias|^2 + |v - v_alias|^2 at layer 0, keys of both
  at this request's positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plan import CHANGE_BLIND, CHANGED, DOWNSTREAM, ENTROPY_AWARE, SIMILAR, ImagePlan
from plan.budget import (  # noqa: F401 (ATTENTION, DEVIATION, changed_tokens: the workers' and benches' names)
    ATTENTION,
    DEVIATION,
    budget,
    changed_tokens,
    drops,
    forced,
    score_kind,
    tight,
)


@dataclass(frozen=True)
class Selection:
    """Image-local token indices, each sorted; together they cover the image once."""

    warmup: int  # W: layers [0, W) compute every token
    recompute: torch.Tensor  # R: computed at every layer
    reuse: torch.Tensor  # B: layers >= W take the alias' K/V at their aligned tokens
    drop: torch.Tensor  # D: invisible at layers >= W (in prefill and in every decode step)

    def summary(self) -> str:
        return f"W={self.warmup} R={len(self.recompute)} B={len(self.reuse)} D={len(self.drop)}"


def candidates(plan: ImagePlan, *, question: bool = True) -> list[int]:
    """The tokens whose alias K/V B may take (the worker reads these): the plan's reuse set B0, or, for
    entropy_aware without the question, every token that is not forced."""
    if plan.selector == ENTROPY_AWARE and not question:
        must = set(forced(plan, question=False))
        return [i for i in range(plan.tokens) if i not in must]
    return list(plan.reuse)


def select(plan: ImagePlan, score: torch.Tensor | None = None, *, question: bool = True) -> Selection:
    """R, B and D for an approximate plan; ``score`` (tokens,) as score_kind(plan, question=question) says (higher
    is recomputed first), None when it says None. Raises ValueError when a needed score is missing or has the
    wrong length."""
    n = plan.tokens
    reuse = set(candidates(plan, question=question))
    must = forced(plan, question=question)
    if tight(plan, question=question):
        if score is None or score.shape != (n,):
            raise ValueError(f"selector {plan.selector} needs a score per token ({n})")
        values = _quantised(score.detach().double().cpu())
        recompute = set(sorted(must, key=lambda i: (-int(values[i]), i))[: budget(plan, question=question)])
        reuse -= recompute
        return Selection(warmup=plan.warmup_layers, recompute=_indices(recompute), reuse=_indices(reuse),
                         drop=_indices(set(range(n)) - reuse - recompute))
    if drops(plan, question):
        pool = [i for i in range(n) if i not in reuse and plan.change_map[i] != CHANGED]
    else:
        pool = sorted(reuse - set(must))
    if score_kind(plan, question=question) is not None:
        if score is None or score.shape != (n,):
            raise ValueError(f"selector {plan.selector} needs a score per token ({n})")
        values = _quantised(score.detach().double().cpu())
        pool.sort(key=lambda i: (-int(values[i]), i))
    if plan.selector == DOWNSTREAM:
        distance = downstream_distance(plan)
        pool.sort(key=lambda i: (distance[i], plan.change_map[i] != SIMILAR, i))
    elif plan.selector not in CHANGE_BLIND:
        pool.sort(key=lambda i: plan.change_map[i] != SIMILAR)  # stable: similar first, each part in its order
    recompute = set(must) | set(pool[: max(0, budget(plan, question=question) - len(must))])
    reuse -= recompute
    drop = set(range(n)) - reuse - recompute
    return Selection(warmup=plan.warmup_layers, recompute=_indices(recompute), reuse=_indices(reuse),
                     drop=_indices(drop))


def downstream_distance(plan: ImagePlan) -> list[float]:
    """Per token: how far (|rows| + |columns| in the grid) it is from the nearest changed token before it in
    reading order; infinity where none comes before it."""
    cols = plan.grid[1]
    sources = torch.tensor([mark == CHANGED for mark in plan.change_map]).nonzero().flatten()
    if not len(sources):
        return [float("inf")] * plan.tokens
    tokens = torch.arange(plan.tokens)
    apart = ((tokens[:, None] // cols - sources[None, :] // cols).abs()
             + (tokens[:, None] % cols - sources[None, :] % cols).abs()).double()
    apart[sources[None, :] >= tokens[:, None]] = float("inf")  # only tokens before it in reading order
    return apart.min(1).values.tolist()


def _quantised(score: torch.Tensor) -> torch.Tensor:
    """Scores in steps of 1e-5 of the largest: closer ones are ties, so that float noise (two implementations, two
    kernels) never decides a rank. Tokens whose K/V match the alias' to rounding (deviation ~1e-12) all tie."""
    top = float(score.abs().max()) if len(score) else 0.0
    return torch.zeros_like(score, dtype=torch.long) if top == 0.0 else (score / top * 1e5).round().long()


def _indices(tokens: set[int]) -> torch.Tensor:
    return torch.tensor(sorted(tokens), dtype=torch.long)


def attention_score(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One layer's contribution to the attention score of each image token.

    probs: (heads, question rows, image tokens) the question rows' attention probabilities on the image's tokens
    (softmax over every key each row sees); values: (image tokens, kv_heads, head_dim) the tokens' value vectors
    at that layer. Returns (image tokens,) float64: sum over heads of the mean attention times the value norm.
    """
    heads, kv_heads = probs.shape[0], values.shape[1]
    norms = values.double().norm(dim=-1).T.repeat_interleave(heads // kv_heads, dim=0)  # (heads, tokens)
    return (probs.double().mean(1) * norms).sum(0)


def deviation_score(k: torch.Tensor, v: torch.Tensor, alias_k: torch.Tensor, alias_v: torch.Tensor) -> torch.Tensor:
    """(tokens,) float64: squared distance of each token's layer-0 K and V (any trailing shape) from the alias'."""
    def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a.double() - b.double()) ** 2).reshape(a.shape[0], -1).sum(1)

    return distance(k, alias_k) + distance(v, alias_v)
