"""The approximate plan as the workers execute it, in the reference's terms: from a gateway plan to an Approximate.

    approximate, selection = execute(model, prompt, plan, encoder, alias)
    result = prefill(model, prompt, [approximate])

``encoder`` is the new image's own (a full vision pass) or, for plan.vision "partial", ``partial_encoder``'s.

``execute`` measures what the plan's selector ranks by (engine_ext.selection), over a full prefill of the prompt:
its first W layers compute exactly what the approximate run's warmup computes (every row, on the new image's
encoder output), so the attention and the layer-0 K/V read there are the warmup's. Then engine_ext.selection
decides R, B and D, the same rule the workers apply to their own measurements.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_ext import selection as select_
from engine_ext.rope import reposition_axes
from engine_ext.selection import Selection
from offline.reference.compare import prefill
from offline.reference.model import EncoderOutput, Prompt, ReferenceModel
from offline.reference.plans import Approximate, Fresh, ImageKV
from offline.reference.plans import ImagePlan as RowsPlan
from plan import SAME, ImagePlan


def partial_encoder(model: ReferenceModel, prompt: Prompt, plan: ImagePlan, alias: ImageKV,
                    *, image: int = 0) -> tuple[EncoderOutput, int]:
    """The new image's encoder output as a partial vision pass makes it (plan.vision "partial"), and how many
    tokens the vision tower encoded: the alias' encoder output at every aligned token, the tower over the tokens
    whose pixels differ (changed or similar) and their margin (engine_ext.vision), as the workers compose it."""
    from engine_ext.vision import margin_tokens, window_tokens_of
    from offline.reference.vision import encode_partial

    h, w = plan.grid
    differ = torch.tensor([mark != SAME for mark in plan.change_map]).view(h, w)
    encode = margin_tokens(differ, arch=model.arch, window_tokens=window_tokens_of(model.hf.model.visual)).flatten()
    tokens = encode.nonzero().flatten()
    stored = alias.encoder.flat()
    composed = stored.new_zeros(plan.tokens, stored.shape[-1])
    sources = torch.tensor(alias_tokens(plan))
    aligned = (sources >= 0).nonzero().flatten()
    composed[aligned] = stored[sources[aligned]]
    if len(tokens):
        composed[tokens] = encode_partial(model, prompt, tokens, image=image).flat().to(composed.dtype)
    return EncoderOutput.from_flat(composed, model.hidden), len(tokens)


def alias_tokens(plan: ImagePlan) -> list[int]:
    """Per token of the new image: the alias token it lines up with, -1 where none."""
    return [-1 if (j := plan.alias_token(i)) is None else j for i in range(plan.tokens)]


@torch.no_grad()
def execute(model: ReferenceModel, prompt: Prompt, plan: ImagePlan, encoder: EncoderOutput, alias: ImageKV,
            *, image: int = 0, others: Sequence[RowsPlan] = (), question: bool = True,
            asking_until: int | None = None) -> tuple[Approximate, Selection]:
    """The Approximate for image ``image`` of prompt under the gateway's ``plan``, and the sets it chose.

    others: the plans of the prompt's other images, in order without this one (default: none, a one-image prompt).
    question: False ranks as a worker does when the question is not computed with the image (chunked prefill:
    engine_ext.selection). asking_until: where the question rows that score the image end (default: the prompt's
    end; under chunked prefill a worker scores with the question rows in the image's extend, which ends there).
    """
    span = prompt.images[image]
    if plan.tokens != len(span):
        raise ValueError(f"plan is for {plan.tokens} tokens, the image has {len(span)}")
    if len(alias) != (plan.alias_grid or plan.grid)[0] * (plan.alias_grid or plan.grid)[1]:
        raise ValueError("the alias entry does not have the plan's alias grid")
    sources = alias_tokens(plan)
    kind = select_.score_kind(plan, question=question)
    score = None
    if kind is not None:
        layers = range(max(plan.warmup_layers, 1))
        plans = [*others[:image], Fresh(encoder), *others[image:]]
        warm = prefill(model, prompt, plans) if kind == select_.DEVIATION else _prefill_attention(
            model, prompt, plans, frozenset(layers))
        if kind == select_.ATTENTION:
            score = torch.zeros(plan.tokens, dtype=torch.float64)
            asking = slice(span.stop, asking_until or len(prompt))  # the question's rows
            for layer in layers:
                probs = warm.attention[layer][:, asking, span.start : span.stop]  # (heads, question, tokens)
                score += select_.attention_score(probs, warm.state.v[layer][span.start : span.stop])
        else:
            score = _deviation(model, prompt, plan, warm.state, alias, span.start, sources)
    chosen = select_.select(plan, score, question=question)
    return Approximate(encoder=encoder, alias=alias, warmup=chosen.warmup, reuse=chosen.reuse.tolist(),
                       recompute=chosen.recompute.tolist(), alias_tokens=sources), chosen


def _prefill_attention(model: ReferenceModel, prompt: Prompt, plans: list[RowsPlan], layers: frozenset[int]):
    from offline.reference.driver import run
    from offline.reference.plans import build

    return run(model, build(model, prompt, plans), prompt.positions, capture_attention=layers)


def _deviation(model: ReferenceModel, prompt: Prompt, plan: ImagePlan, state, alias: ImageKV, start: int,
               sources: list[int]) -> torch.Tensor:
    """Layer 0's K/V deviation from the alias' per token (0 where there is no alias token; those are changed)."""
    score = torch.zeros(plan.tokens, dtype=torch.float64)
    rows = torch.tensor([i for i, j in enumerate(sources) if j >= 0], dtype=torch.long)
    source = torch.tensor([sources[i] for i in rows.tolist()], dtype=torch.long)
    deltas = prompt.positions[:, start + rows] - alias.positions[:, source]
    alias_k = reposition_axes(alias.k[0, source], deltas, model.inv_freq, model.frequency_axes)
    score[rows] = select_.deviation_score(state.k[0][start + rows], state.v[0][start + rows], alias_k,
                                          alias.v[0, source])
    return score
