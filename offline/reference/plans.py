"""Reuse plans in the reference's terms: which image rows are computed, reused or dropped at which layer.

Per image of a prompt, one of:

    Fresh(encoder)                      a miss: every row computed from the vision tower's output
    Reuse(cached, ratios)               an exact hit: the image's encoder output and KV come from cached (taken from
                                        any earlier prompt); keys are moved to this prompt's positions; at layer l the
                                        first floor(ratios[l] * n) image rows are recomputed, the rest reused.
                                        Same text before the image and ratios all 0: identical to a miss.
    Approximate(encoder, alias, ...)    a similar image: layers < warmup run every row on the new image's encoder
                                        output; at layers >= warmup the rows in `recompute` are computed, the rows
                                        in `reuse` take the alias entry's KV at their aligned alias token (the same
                                        grid position unless `alias_tokens` says otherwise; keys turned per M-RoPE
                                        axis to the row's own position), all other rows are dropped (invisible from
                                        then on, in prefill and decode). offline.reference.approximate makes one
                                        from a gateway plan, choosing the sets as the workers do.

Text rows are always computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_ext.rope import reposition, reposition_axes
from offline.reference.driver import COMPUTE, DROP, REUSE, KVState, RowPlan
from offline.reference.model import EncoderOutput, ImageSpan, Prompt, ReferenceModel
from plan import check_ratios, recompute_count


@dataclass(frozen=True)
class ImageKV:
    """One image's cached state, as the store keeps it: encoder output, and K (after RoPE, at `positions`) and V
    of its rows at every layer."""

    encoder: EncoderOutput
    k: torch.Tensor  # (layers, n, kv_heads, head_dim)
    v: torch.Tensor
    positions: torch.Tensor  # (3, n)
    grid: tuple[int, int, int]

    def __len__(self) -> int:
        return int(self.k.shape[1])


def capture(state: KVState, span: ImageSpan, encoder: EncoderOutput) -> ImageKV:
    """The entry a full prefill of a prompt leaves for one of its images."""
    rows = slice(span.start, span.stop)
    assert state.positions is not None, "capture takes the state of a prefill"
    return ImageKV(encoder=encoder, k=torch.stack([k[rows] for k in state.k]),
                   v=torch.stack([v[rows] for v in state.v]), positions=state.positions[:, rows].clone(),
                   grid=span.grid)


@dataclass(frozen=True)
class Fresh:
    encoder: EncoderOutput


@dataclass(frozen=True)
class Reuse:
    cached: ImageKV
    ratios: Sequence[float]  # per layer, non-increasing, in [0, 1]


@dataclass(frozen=True)
class Approximate:
    encoder: EncoderOutput  # the new image's own
    alias: ImageKV
    warmup: int  # W
    reuse: Sequence[int]  # B: rows (image-local) whose late-layer KV come from the alias
    recompute: Sequence[int]  # R: rows computed at every layer
    alias_tokens: Sequence[int] | None = None  # per row: the alias token it lines up with (-1: none); None: itself


ImagePlan = Fresh | Reuse | Approximate


def uniform(ratio: float, layers: int) -> tuple[float, ...]:
    return (ratio,) * layers


def build(model: ReferenceModel, prompt: Prompt, images: Sequence[ImagePlan]) -> RowPlan:
    """The RowPlan that executes one plan per image of prompt (in prompt order)."""
    if len(images) != len(prompt.images):
        raise ValueError(f"prompt has {len(prompt.images)} images, got {len(images)} plans")
    layers, rows = model.num_layers, len(prompt)
    modes = torch.full((layers, rows), COMPUTE, dtype=torch.int8)
    embeds = model.embed_tokens(prompt.input_ids).clone()
    deepstack_layers = max((len(_encoder(p).deepstack) for p in images), default=0)
    deepstack = [torch.zeros_like(embeds) for _ in range(deepstack_layers)]
    reuse_k = reuse_v = None

    for span, plan in zip(prompt.images, images, strict=True):
        encoder = _encoder(plan)
        if encoder.embeds.shape[0] != len(span):
            raise ValueError(f"image at rows {span.start}..{span.stop} has {len(span)} tokens, its encoder output "
                             f"{encoder.embeds.shape[0]}")
        embeds[span.start : span.stop] = encoder.embeds.to(embeds.dtype)
        for layer_index, extra in enumerate(encoder.deepstack):
            deepstack[layer_index][span.start : span.stop] = extra.to(embeds.dtype)
        if isinstance(plan, Fresh):
            continue
        cached = plan.cached if isinstance(plan, Reuse) else plan.alias
        if reuse_k is None or reuse_v is None:  # first reused image: both are set together
            reuse_k = torch.zeros(layers, rows, model.kv_heads, model.head_dim, dtype=cached.k.dtype)
            reuse_v = torch.zeros_like(reuse_k)
        now = prompt.positions[:, span.start : span.stop]
        if isinstance(plan, Approximate):
            aligned, sources = _aligned(plan, len(span))
            rows_aligned = span.start + aligned
            deltas = now[:, aligned] - cached.positions[:, sources]  # (3, aligned rows)
            reuse_k[:, rows_aligned] = reposition_axes(cached.k[:, sources], deltas, model.inv_freq,
                                                       model.frequency_axes)
            reuse_v[:, rows_aligned] = cached.v[:, sources]
        else:
            if cached.grid != span.grid:
                raise ValueError(f"cached grid {cached.grid} differs from the image's {span.grid}")
            delta = _shift(cached.positions, now)
            reuse_k[:, span.start : span.stop] = reposition(cached.k, delta, model.inv_freq)
            reuse_v[:, span.start : span.stop] = cached.v
        image_modes = modes[:, span.start : span.stop]
        if isinstance(plan, Reuse):
            ratios = check_ratios(plan.ratios, layers) or (0.0,) * layers  # none given: nothing recomputed
            for layer_index, ratio in enumerate(ratios):
                image_modes[layer_index, recompute_count(ratio, len(span)) :] = REUSE
        else:
            _approximate_modes(image_modes, plan, len(span))

    return RowPlan(modes=modes, embeds=embeds, reuse_k=reuse_k, reuse_v=reuse_v, deepstack=tuple(deepstack))


def _aligned(plan: Approximate, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows with an alias token, those alias tokens), image-local."""
    if plan.alias_tokens is None:
        if len(plan.alias) != n:
            raise ValueError(f"alias has {len(plan.alias)} tokens, the image {n}: alias_tokens must align them")
        rows = torch.arange(n)
        return rows, rows
    sources = torch.tensor(list(plan.alias_tokens), dtype=torch.long)
    if sources.shape != (n,) or bool((sources >= len(plan.alias)).any()):
        raise ValueError(f"alias_tokens must name an alias token (or -1) for each of the {n} rows")
    if any(sources[i] < 0 for i in plan.reuse):
        raise ValueError("a reused row has no alias token")
    rows = (sources >= 0).nonzero().flatten()
    return rows, sources[rows]


def _encoder(plan: ImagePlan) -> EncoderOutput:
    return plan.cached.encoder if isinstance(plan, Reuse) else plan.encoder


def _shift(cached: torch.Tensor, now: torch.Tensor) -> int:
    """The one offset that moves the cached image's positions (3, n) onto now's; an image moves as a whole."""
    delta = now - cached
    if not (delta == delta[0, 0]).all():
        raise ValueError("the image's positions do not differ by one offset (different grid or layout)")
    return int(delta[0, 0])


def _approximate_modes(image_modes: torch.Tensor, plan: Approximate, n: int) -> None:
    reuse, recompute = set(plan.reuse), set(plan.recompute)
    if reuse & recompute:
        raise ValueError("a row cannot be both reused and recomputed")
    if any(not 0 <= i < n for i in reuse | recompute):
        raise ValueError(f"row indices must be in [0, {n})")
    if not 0 <= plan.warmup <= image_modes.shape[0]:
        raise ValueError(f"warmup must be in [0, {image_modes.shape[0]}]")
    late = image_modes[plan.warmup :]
    late[:] = DROP
    late[:, sorted(recompute)] = COMPUTE
    late[:, sorted(reuse)] = REUSE
