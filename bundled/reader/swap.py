"""Sibling swap: the oracle's training-time attention, which makes reading below a layer useless.

A training batch holds each question twice: over its panels and over a sibling's (the same layout and keys, every
value drawn afresh; bundled.reader.questions). At decoder layers below ``layers``, the question's rows (every row
after the last image) attend to the *partner's* K/V over the images' span (its image rows, and the text rows
between two images, which have read the first image) in place of their own: same positions and layout,
independent values. Every other row attends as usual. So below ``layers`` a question can find where a field is
but not what it holds, and its answer has to come from the image K/V of the layers at and above ``layers``, which
is what the reuse probe (offline.reader_eval probe) checks on the trained model.

``withhold`` is the alternative the swap was chosen over by measurement (README, "The readers"): below
``layers`` the question's rows see no image at all; training releases them after ``--withhold-until`` steps.

The partner's K/V are detached: a question's loss never shapes the other image's early rows. Outside a
``swapping`` block (evaluation, export, serving) the attention is transformers' SDPA, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

NAME = "revisit_sibling_swap"


@dataclass(frozen=True)
class Swap:
    partner: torch.Tensor  # (batch,) the index of each row's sibling in the batch
    span: torch.Tensor  # (batch, tokens) bool: first to last image token (identical between partners)
    layers: int  # the question's rows see the partner's span at decoder layers below this one
    # The alternative measured against the swap: the question's rows see no span at all below ``layers``.
    withhold: bool = False

    @classmethod
    def over(cls, input_ids: torch.Tensor, image_token_id: int, partner: torch.Tensor, layers: int,
             withhold: bool = False) -> Swap:
        image = input_ids == image_token_id
        if not torch.equal(image, image[partner]):
            raise ValueError("a question and its sibling must have their image tokens at the same rows")
        index = torch.arange(input_ids.shape[1])
        first = torch.where(image, index, input_ids.shape[1]).min(1).values
        last = torch.where(image, index, -1).max(1).values
        span = (index >= first[:, None]) & (index <= last[:, None])
        return cls(partner=partner, span=span, layers=layers, withhold=withhold)

    @property
    def questions(self) -> torch.Tensor:
        """(batch, tokens) bool: the rows after the span."""
        after = self.span.flip(1).cumsum(1).flip(1) == 0
        return after & self.span.any(1, keepdim=True)


_active: ContextVar[Swap | None] = ContextVar("sibling_swap", default=None)


def attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    swap = _active.get()
    if swap is None or module.layer_idx >= swap.layers:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0], None
    if swap.withhold:
        hidden = swap.questions[:, None, :, None] & swap.span[:, None, None, :]  # (batch, 1, query, key)
        withheld, _ = sdpa_attention_forward(module, query, key, value, _allowed(attention_mask, query) & ~hidden,
                                             **kwargs)
        return withheld, None
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # the image's own rows
    span = swap.span[:, None, :, None]  # key/value: (batch, kv_heads, tokens, head_dim)
    key = torch.where(span, key[swap.partner].detach(), key)
    value = torch.where(span, value[swap.partner].detach(), value)
    swapped, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return torch.where(swap.questions[:, :, None, None], swapped, out), None  # out: (batch, tokens, heads, dim)


def _allowed(attention_mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The attention mask as booleans (True: may attend), causal when transformers passed none."""
    if attention_mask is None:
        tokens = query.shape[2]
        return torch.ones(tokens, tokens, dtype=torch.bool, device=query.device).tril()[None, None]
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


def install(model) -> None:
    """Route the language model's attention through ``attention`` (the vision tower keeps its own)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    model.config.text_config._attn_implementation = NAME
    for layer in model.model.language_model.layers:
        if layer.self_attn.config._attn_implementation != NAME:
            raise RuntimeError("the language model's attention did not take the sibling swap")


@contextmanager
def swapping(swap: Swap | None) -> Iterator[None]:
    token = _active.set(swap)
    try:
        yield
    finally:
        _active.reset(token)
