"""Reuse measured against full prefill: next-token KL and top-1 agreement over greedy tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offline.reference import plans
from offline.reference.driver import KVState, RunResult, decode, run
from offline.reference.model import Prompt, ReferenceModel


@dataclass(frozen=True)
class Divergence:
    kl: float  # KL(full || reuse) of the first generated token's distribution, in nats
    top1_agreement: float  # share of steps where reuse's argmax equals full prefill's greedy token
    max_logit_diff: float  # first step


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats between the softmax distributions of two logit vectors, in float64."""
    p_log = p_logits.double().log_softmax(-1)
    q_log = q_logits.double().log_softmax(-1)
    return float((p_log.exp() * (p_log - q_log)).sum().clamp_min(0.0))


def prefill(model: ReferenceModel, prompt: Prompt, images: Sequence[plans.ImagePlan]) -> RunResult:
    return run(model, plans.build(model, prompt, images), prompt.positions)


def greedy(model: ReferenceModel, first: RunResult, steps: int) -> list[int]:
    """Greedy tokens after a prefill: steps tokens, the first from the prefill's own logits."""
    tokens, result = [], first
    for _ in range(steps):
        tokens.append(int(result.logits.argmax()))
        result = decode(model, result.state, tokens[-1])
    return tokens


def teacher_forced(model: ReferenceModel, first: RunResult, tokens: Sequence[int]) -> list[int]:
    """The argmax at each step when fed the given tokens (so one early difference does not derail the rest)."""
    choices, result = [], first
    for token in tokens:
        choices.append(int(result.logits.argmax()))
        result = decode(model, result.state, token)
    return choices


def divergence(model: ReferenceModel, full: RunResult, reuse: RunResult, steps: int = 32,
               reference_tokens: Sequence[int] | None = None) -> Divergence:
    tokens = list(reference_tokens) if reference_tokens is not None else greedy(model, full, steps)
    choices = teacher_forced(model, reuse, tokens[:steps])
    agree = sum(a == b for a, b in zip(tokens, choices, strict=False)) / len(choices)
    return Divergence(kl=kl_divergence(full.logits, reuse.logits), top1_agreement=agree,
                      max_logit_diff=float((full.logits - reuse.logits).abs().max()))


def clone_state(state: KVState) -> KVState:
    return KVState(k=list(state.k), v=list(state.v), visible=list(state.visible), positions=state.positions)
