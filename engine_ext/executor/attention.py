"""Causal attention for some of an extend (or decode) batch's rows, over their sequences' K/V in the KV pool.

SGLang's extend attention needs a query for every extend row (on CPU it even pads each sequence's queries to its
full length), so its cost grows with the whole sequence squared whether or not a row's output is used. Here every
extend row's K/V is written to its pool slot, as the backend would, and then only the given rows ask: per
sequence, its active queries against its keys up to each query's own position.

:func:`attend_rows` is the computation, on plain tensors (tested on every device without SGLang);
:class:`PoolAttention` binds it to SGLang's batch and KV pool. Keys can be hidden per sequence (an approximate
plan's dropped tokens, at the layers it drops them), and :func:`attention_probs` gives the probabilities some
rows' queries put on some keys (the question's attention on an image, in the warmup layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sequences:
    """The sequences of an extend batch, as attention needs them; every tensor on the batch's device."""

    ends: torch.Tensor  # (sequences,) end extend row of each sequence (exclusive); sequence i starts at ends[i-1]
    slots: Sequence[torch.Tensor]  # per sequence: the pool slots of its rows, prefix included: (seq_len,)
    where: torch.Tensor  # (extend rows,) each extend row's position in its own sequence

    @classmethod
    def of(cls, *, prefix_lens: Sequence[int], extend_lens: Sequence[int], slots: Sequence[torch.Tensor],
           device: torch.device) -> Sequences:
        where = [torch.arange(int(p), int(p) + int(e), device=device) for p, e in zip(prefix_lens, extend_lens,
                                                                                         strict=True)]
        ends = torch.tensor(extend_lens, device=device).cumsum(0)
        return cls(ends=ends, slots=list(slots), where=torch.cat(where) if where else ends.new_empty(0))

    def starts(self) -> list[int]:
        """The first extend row of each sequence."""
        return [0, *self.ends[:-1].tolist()]


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequences: Sequences,
                active: torch.Tensor, *, scaling: float, heads: int, kv_heads: int,
                hidden: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """Causal attention of the active extend rows' queries over their sequences' keys and values.

    q: (len(active), heads * head_dim) for the extend rows ``active`` (sorted); keys, values: the pool's buffers
    (pool slots, kv_heads, head_dim) holding every row of every sequence; hidden: per sequence, None or a bool
    (seq_len,) of keys no query may see. Returns (len(active), heads * v_head_dim).
    """
    head_dim, v_head_dim = keys.shape[-1], values.shape[-1]
    out = q.new_empty(q.shape[0], heads * v_head_dim)
    bounds = torch.searchsorted(active, sequences.ends).tolist()
    first = 0
    for index, (slots, last) in enumerate(zip(sequences.slots, bounds, strict=True)):
        if last == first:
            continue
        asking = sequences.where[active[first:last]]  # (queries,) positions in the sequence
        query = q[first:last].view(-1, heads, head_dim).transpose(0, 1).unsqueeze(0)  # (1, heads, queries, hd)
        key = keys[slots].transpose(0, 1).unsqueeze(0).to(query.dtype)  # (1, kv_heads, seq_len, hd)
        value = values[slots].transpose(0, 1).unsqueeze(0).to(query.dtype)
        mask = torch.arange(len(slots), device=q.device).unsqueeze(0) <= asking.unsqueeze(1)  # (queries, seq_len)
        masked = hidden[index] if hidden is not None else None
        if masked is not None:
            mask &= ~masked
        attended = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=heads != kv_heads)
        out[first:last] = attended.squeeze(0).transpose(0, 1).reshape(last - first, -1)
        first = last
    return out


def attention_probs(q: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, where: torch.Tensor,
                    columns: slice, *, scaling: float, heads: int) -> torch.Tensor:
    """(heads, rows, columns) float32: the attention probabilities some rows of one sequence put on some of its keys.

    q: (rows, heads * head_dim) those rows' queries; keys: the pool's key buffer; slots: (seq_len,) the sequence's
    pool slots; where: (rows,) each row's position in the sequence; columns: the keys asked about (positions in
    the sequence). The softmax runs over every key each row sees (causal), as the layer's own attention does.
    """
    kv_heads, head_dim = keys.shape[-2], keys.shape[-1]
    query = q.float().view(-1, heads, head_dim).transpose(0, 1)  # (heads, rows, hd)
    key = keys[slots].float().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)  # (heads, seq_len, hd)
    scores = query @ key.transpose(1, 2) * scaling  # (heads, rows, seq_len)
    seen = torch.arange(len(slots), device=q.device).unsqueeze(0) <= where.unsqueeze(1)
    return scores.masked_fill(~seen, float("-inf")).softmax(-1)[:, :, columns]


class PoolAttention:
    """attend_rows over SGLang's KV pool for one extend or decode batch (see the module docstring)."""

    def __init__(self, forward_batch) -> None:
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        self.pool = get_token_to_kv_pool()
        self.out_cache_loc = forward_batch.out_cache_loc
        req_to_token = get_req_to_token_pool().req_to_token
        seq_lens = forward_batch.seq_lens.tolist()
        slots = [req_to_token[pool_index, : seq_lens[i]].long()
                 for i, pool_index in enumerate(forward_batch.req_pool_indices.tolist())]
        if forward_batch.forward_mode.is_decode():  # one new row per sequence, after everything before it
            prefix_lens, extend_lens = [n - 1 for n in seq_lens], [1] * len(seq_lens)
        else:
            prefix_lens, extend_lens = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        self.sequences = Sequences.of(prefix_lens=prefix_lens, extend_lens=extend_lens, slots=slots,
                                      device=self.out_cache_loc.device)
        self.hidden: list[torch.Tensor | None] = [None] * len(slots)  # per sequence: keys hidden at this layer

    def hide(self, sequence: int, positions: torch.Tensor) -> None:
        """From now on (this layer and the later ones), no query sees these positions of the sequence's keys."""
        hidden = self.hidden[sequence]
        if hidden is None:
            hidden = torch.zeros(len(self.sequences.slots[sequence]), dtype=torch.bool,
                                 device=self.out_cache_loc.device)
            self.hidden[sequence] = hidden
        hidden[positions.to(hidden.device)] = True

    def __call__(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Write every batch row's k, v (batch rows, kv_size) to its pool slot; attend for the active rows' q."""
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        heads, kv_heads, head_dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        self.pool.set_kv_buffer(layer, KVWriteLoc(self.out_cache_loc), k.view(-1, kv_heads, head_dim),
                                v.view(-1, kv_heads, layer.v_head_dim))
        keys, values = self.pool.get_key_buffer(layer.layer_id), self.pool.get_value_buffer(layer.layer_id)
        return attend_rows(q, keys, values, self.sequences, active, scaling=layer.scaling, heads=heads,
                           kv_heads=kv_heads, hidden=self.hidden)

    def probs(self, layer, q: torch.Tensor, sequence: int, rows: torch.Tensor, columns: slice) -> torch.Tensor:
        """attention_probs for batch rows ``rows`` of one sequence (q: their queries), after this layer's call."""
        return attention_probs(q, self.pool.get_key_buffer(layer.layer_id), self.sequences.slots[sequence],
                               self.sequences.where[rows], columns, scaling=layer.scaling, heads=layer.tp_q_head_num)
