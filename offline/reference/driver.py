"""The decoder run layer by layer, with each row of the prompt computed, reused or dropped at each layer.

This is the reference for every reuse path: small on purpose, plain PyTorch, float32 attention written out
(no fused kernels), so it is easy to check by reading. A ``RowPlan`` says, for every layer l and prompt row i:

    COMPUTE  the row's hidden state goes through layer l; its K/V come from that computation
    REUSE    the row is not computed at layer l; its K/V at layer l are given (e.g. read from the store)
    DROP     the row is invisible at layer l: no query, no key, in this prefill and in every later decode step

A row computed at layer l must have been computed at every layer before it (its hidden state must exist), so
the computed set only shrinks with depth. With every row COMPUTE the run is an ordinary prefill, and matches
transformers' forward (tests/offline/test_reference.py).

Keys are kept after RoPE, as serving engines keep them in their KV pools; ``engine_ext.rope.reposition`` moves
keys computed at one position to another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_ext.rope import reposition, rotate_half  # noqa: F401 (reposition re-exported)
from offline.reference.model import ReferenceModel

COMPUTE, REUSE, DROP = 0, 1, 2


@dataclass
class RowPlan:
    """What happens to each row at each layer of one prefill.

    modes:      (layers, rows) int8 of COMPUTE / REUSE / DROP
    embeds:     (rows, hidden) layer-0 input; read for rows computed at layer 0
    reuse_k/v:  (layers, rows, kv_heads, head_dim) K (after RoPE, at this prompt's positions) and V; read where
                modes == REUSE, ignored elsewhere (None when nothing is reused)
    deepstack:  Qwen3-VL: (rows, hidden) additions to the hidden states after layers 0..len-1 (zero on text rows)
    """

    modes: torch.Tensor
    embeds: torch.Tensor
    reuse_k: torch.Tensor | None = None
    reuse_v: torch.Tensor | None = None
    deepstack: tuple[torch.Tensor, ...] = ()

    def validate(self) -> None:
        layers, rows = self.modes.shape
        computed = self.modes == COMPUTE
        if (computed[1:] & ~computed[:-1]).any():
            raise ValueError("a row computed at a layer must be computed at every earlier layer")
        if not computed[:, -1].all():
            raise ValueError("the last row must be computed at every layer (its logits are the output)")
        if (self.modes == REUSE).any() and (self.reuse_k is None or self.reuse_v is None):
            raise ValueError("REUSE rows need reuse_k and reuse_v")
        if self.embeds.shape[0] != rows:
            raise ValueError(f"embeds has {self.embeds.shape[0]} rows, modes {rows}")


@dataclass
class KVState:
    """What a run leaves behind for later steps: per layer, K (after RoPE) and V of every row so far, and which
    rows are visible at that layer; and every row's M-RoPE position."""

    k: list[torch.Tensor] = field(default_factory=list)  # per layer (rows, kv_heads, head_dim)
    v: list[torch.Tensor] = field(default_factory=list)
    visible: list[torch.Tensor] = field(default_factory=list)  # per layer (rows,) bool
    positions: torch.Tensor | None = None  # (3, rows)

    @property
    def rows(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[1])


@dataclass
class RunResult:
    logits: torch.Tensor  # (vocab,) float32, at the last row
    state: KVState
    attention: dict[int, torch.Tensor]  # layer -> (heads, computed rows, all rows) probabilities, when asked
    tail_logits: torch.Tensor | None = None  # (tail, vocab) float32 at the last `tail` rows, when asked


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (rows, heads, head_dim); cos/sin (rows, head_dim)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@torch.no_grad()
def run(model: ReferenceModel, plan: RowPlan, positions: torch.Tensor, past: KVState | None = None,
        capture_attention: frozenset[int] = frozenset(), tail: int = 1) -> RunResult:
    """Run the rows of plan after the rows already in past (a prefill: past None; a decode step: one new row).

    tail > 1 also returns the logits of the last `tail` rows (all computed at every layer), e.g. to score a
    known continuation in one pass.
    """
    plan.validate()
    past = past or KVState()
    layers, rows = plan.modes.shape
    first = past.rows
    cos, sin = model.rope(positions, plan.embeds)
    query_index = torch.arange(first, first + rows)
    key_index = torch.arange(first + rows)
    active = (plan.modes[0] == COMPUTE).nonzero().flatten()
    x = plan.embeds[active]
    state = KVState(positions=positions if past.positions is None else torch.cat([past.positions, positions], 1))
    attention: dict[int, torch.Tensor] = {}
    for layer_index, layer in enumerate(model.layers):
        modes = plan.modes[layer_index]
        now = (modes == COMPUTE).nonzero().flatten()
        if not torch.equal(now, active):  # rows leave the computed set: keep the others' hidden states
            x = x[torch.isin(active, now)]
            active = now
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(len(active), -1, model.head_dim)
        k = attn.k_proj(h).view(len(active), -1, model.head_dim)
        v = attn.v_proj(h).view(len(active), -1, model.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos[active], sin[active]), apply_rope(k, cos[active], sin[active])

        k_rows = torch.zeros(rows, model.kv_heads, model.head_dim, dtype=k.dtype)
        v_rows = torch.zeros_like(k_rows)
        k_rows[active], v_rows[active] = k, v
        reused = (modes == REUSE).nonzero().flatten()
        if len(reused):
            assert plan.reuse_k is not None and plan.reuse_v is not None  # plan.validate() checked it
            k_rows[reused] = plan.reuse_k[layer_index, reused].to(k.dtype)
            v_rows[reused] = plan.reuse_v[layer_index, reused].to(v.dtype)
        visible_rows = modes != DROP
        if past.rows:
            k_all = torch.cat([past.k[layer_index], k_rows])
            v_all = torch.cat([past.v[layer_index], v_rows])
            visible = torch.cat([past.visible[layer_index], visible_rows])
        else:
            k_all, v_all, visible = k_rows, v_rows, visible_rows
        state.k.append(k_all)
        state.v.append(v_all)
        state.visible.append(visible)

        out, probs = _attention(q, k_all, v_all, query_index[active], key_index, visible, attn.scaling)
        if layer_index in capture_attention:
            attention[layer_index] = probs
        x = x + attn.o_proj(out.reshape(len(active), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if layer_index < len(plan.deepstack):
            x = x + plan.deepstack[layer_index][active].to(x.dtype)

    if not torch.equal(active[len(active) - tail :], torch.arange(rows - tail, rows)):
        raise ValueError(f"the last {tail} rows were not all computed")
    logits = model.logits(x[-tail:]).float()
    return RunResult(logits=logits[-1], state=state, attention=attention, tail_logits=logits if tail > 1 else None)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_index: torch.Tensor,
               key_index: torch.Tensor, visible: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention by row index over visible keys; q (n, heads, d), k/v (rows, kv_heads, d), in float32."""
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)  # kv head j serves query heads j*groups .. (j+1)*groups-1
    v = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.float(), k) * scaling
    allowed = (key_index[None, :] <= query_index[:, None]) & visible[None, :]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("hnk,khd->nhd", probs, v)
    return out.to(q.dtype), probs


@torch.no_grad()
def decode(model: ReferenceModel, state: KVState, token: int) -> RunResult:
    """One greedy-decoding step: the next text row after everything in state, computed at every layer."""
    assert state.positions is not None, "decode continues a run's state"
    position = state.positions.max() + 1
    plan = RowPlan(modes=torch.full((model.num_layers, 1), COMPUTE, dtype=torch.int8),
                   embeds=model.embed_tokens(torch.tensor([token])))
    return run(model, plan, torch.full((3, 1), int(position)), state)
