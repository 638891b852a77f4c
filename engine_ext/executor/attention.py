"""Causal attention for some of an extend (or decode) batch's rows, over their sequences' K/V in the KV pool.

SGLang's extend attention needs a query for every extend row (on CPU it even pads each sequence's queries to its
full length), so its cost grows with the whole sequence squared whether or not a row's output is used. Here every
extend row's K/V is written to its pool slot, as the backend would, and then only the given rows ask: per
sequence, its active queries against its keys up to each query's own position.

:func:`attend_rows` is the computation, on plain tensors (tested on every device without SGLang);
:class:`PoolAttention` binds it to SGLang's batch and KV pool. Keys can be hidden per sequence (an approximate
plan's dropped tokens, at the layers it drops them), and :func:`attention_probs` gives the probabilities some
rows' queries put on some keys (the question's attention on an image, in the warmup layers).

:func:`attend_rows_batched` gives attend_rows' results with one SDPA call per group of sequences instead of one
per sequence (the loop's launches and host work dominate on a GPU for many short sequences); PoolAttention uses it
on CUDA, attend_rows elsewhere, unless ``REVISIT_ROWS_ATTENTION`` says otherwise (see :data:`ROWS_ATTENTION`).
"""

from __future__ import annotations

import os
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


# Which of the two PoolAttention runs: "auto" (attend_rows_batched on CUDA, attend_rows elsewhere), "loop"
# (attend_rows everywhere) or "batched" (attend_rows_batched everywhere). Read once at import from
# REVISIT_ROWS_ATTENTION; tests and benches may set the module attribute instead.
ROWS_ATTENTION = os.environ.get("REVISIT_ROWS_ATTENTION", "auto")

# The most elements one batched SDPA call may pad to (see padded_elements); 256M, i.e. 512 MiB of bf16 scores in
# the worst (math) kernel. A batch above it is split into groups of consecutive sequences that fit.
BATCHED_ELEMENTS = 1 << 28


def padded_elements(sequences: int, queries: int, keys: int, *, heads: int, kv_heads: int, head_dim: int,
                    v_head_dim: int) -> int:
    """The elements of one batched call over ``sequences`` padded to ``queries`` queries and ``keys`` keys each.

    The scores (sequences, heads, queries, keys): what the math kernel materializes, and an upper bound on the
    mask and the efficient kernel's float bias; plus the padded keys and values (sequences, kv_heads, keys,
    head_dim). The queries themselves are fewer than the scores (queries <= keys, head_dim <= keys in practice).
    """
    return sequences * keys * (heads * queries + kv_heads * (head_dim + v_head_dim))


def attend_rows_batched(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequences: Sequences,
                        active: torch.Tensor, *, scaling: float, heads: int, kv_heads: int,
                        hidden: Sequence[torch.Tensor | None] | None = None,
                        limit: int = BATCHED_ELEMENTS) -> torch.Tensor:
    """attend_rows (same arguments, same result up to float rounding) with one SDPA call per group of sequences.

    Each group's keys and values are gathered from the pool into a padded (sequences, kv_heads, keys, head_dim)
    and its active queries into a padded (sequences, heads, queries, head_dim); a boolean mask says which keys
    each query sees (its causal limit, not the padding, not the sequence's hidden keys). The cost is the padding:
    every sequence pays for the group's longest sequence and its most active rows (:func:`padded_elements`), so
    consecutive sequences are grouped while the group stays within ``limit`` elements (a sequence alone above it
    still runs, alone: that is the loop's own cost). Sequences without active rows are left out.
    """
    head_dim, v_head_dim = keys.shape[-1], values.shape[-1]
    out = q.new_empty(q.shape[0], heads * v_head_dim)
    bounds = torch.searchsorted(active, sequences.ends).tolist()  # one host sync, as in attend_rows
    cost = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim)
    group: list[int] = []  # the sequences of the group being gathered
    counts: list[int] = []  # their active rows
    first = row = widest = 0  # the group's first active row, the next one, its longest sequence
    for index, last in enumerate(bounds):
        count, length = last - row, len(sequences.slots[index])
        if count == 0:
            continue
        if group and padded_elements(len(group) + 1, max(*counts, count), max(widest, length), **cost) > limit:
            out[first:row] = _attend_group(q[first:row], keys, values, sequences, active[first:row], group, counts,
                                           scaling=scaling, heads=heads, kv_heads=kv_heads, hidden=hidden)
            group, counts, first, widest = [], [], row, 0
        group.append(index)
        counts.append(count)
        row, widest = last, max(widest, length)
    if group:
        out[first:row] = _attend_group(q[first:row], keys, values, sequences, active[first:row], group, counts,
                                       scaling=scaling, heads=heads, kv_heads=kv_heads, hidden=hidden)
    return out


def _attend_group(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequences: Sequences,
                  active: torch.Tensor, group: list[int], counts: list[int], *, scaling: float, heads: int,
                  kv_heads: int, hidden: Sequence[torch.Tensor | None] | None) -> torch.Tensor:
    """One padded SDPA call for the active rows ``active`` (queries q) of the sequences ``group`` (consecutive
    among those with active rows, ``counts`` rows each, at least one); returns (len(active), heads * v_head_dim).
    Nothing here waits on the device: the sizes come from the host (slot counts, ``counts``).

    Grouped-query heads are folded into the query axis: the (heads // kv_heads) query heads sharing a kv head ask
    as one head with that many times the queries, so that query and key heads match. SDPA's enable_gqa would do
    the same sum, but on CUDA only the math kernel takes it with a mask (the memory-efficient kernel refuses
    grouped heads), and the math kernel materializes the scores and repeats the keys and values per query head.
    """
    device, n, group_size = q.device, len(group), heads // kv_heads
    head_dim, v_head_dim = keys.shape[-1], values.shape[-1]
    slots = [sequences.slots[index] for index in group]
    lengths = torch.tensor([len(s) for s in slots], device=device)
    # keys per sequence, rounded up to 8: the efficient kernel wants the mask's rows aligned, and copies it if not
    width = -(-max(len(s) for s in slots) // 8) * 8

    # which sequence of the group each active row is in (owner), and its rank among that sequence's active rows
    rows, most = len(active), max(counts)
    per = torch.tensor(counts, device=device)
    owner = torch.repeat_interleave(torch.arange(n, device=device), per, output_size=rows)
    rank = torch.arange(rows, device=device) - (per.cumsum(0) - per)[owner]

    # keys and values, (n, kv_heads, width, head_dim); padding reads slot 0 and is zeroed (it is masked out, but
    # a pool slot outside a sequence may hold anything, and a NaN there would reach the output through 0 * NaN)
    columns = torch.arange(width, device=device)
    inside = columns < lengths.unsqueeze(1)  # (n, width)
    gather = torch.zeros(n, width, dtype=torch.long, device=device)
    gather.masked_scatter_(inside, torch.cat(slots).to(device=device, dtype=torch.long))  # row-major: in order
    key = keys[gather].to(q.dtype).masked_fill_(~inside[:, :, None, None], 0).transpose(1, 2)
    value = values[gather].to(q.dtype).masked_fill_(~inside[:, :, None, None], 0).transpose(1, 2)

    # queries, (n, most, heads, head_dim) padded with zeros, then folded to (n, kv_heads, group_size * most, hd)
    query = q.new_zeros(n, most, heads, head_dim)
    query[owner, rank] = q.view(-1, heads, head_dim)
    query = query.view(n, most, kv_heads, group_size, head_dim).permute(0, 2, 3, 1, 4)
    query = query.reshape(n, kv_heads, group_size * most, head_dim)

    # the mask, (n, 1, group_size * most, width): each query sees keys up to its own position; a padded query asks
    # at position 0 (a real key of every sequence here, so that its row is not all masked) and is dropped after
    asking = torch.zeros(n, most, dtype=torch.long, device=device)
    asking[owner, rank] = sequences.where[active]
    mask = columns <= asking.unsqueeze(2)  # (n, most, width); the padding keys are past every query's position
    if hidden is not None and any(hidden[index] is not None for index in group):
        masked = torch.zeros(n, width, dtype=torch.bool, device=device)
        for at, index in enumerate(group):
            seen_not = hidden[index]
            if seen_not is not None:
                masked[at, : len(seen_not)] = seen_not
        mask &= ~masked.unsqueeze(1)
    mask = mask.unsqueeze(1).expand(n, group_size, most, width).reshape(n, 1, group_size * most, width)

    attended = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    attended = attended.view(n, kv_heads, group_size, most, v_head_dim).permute(0, 3, 1, 2, 4)  # (n, most, kv, g, vd)
    return attended[owner, rank].reshape(rows, heads * v_head_dim)


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


def rows_attention(q: torch.Tensor):
    """attend_rows or attend_rows_batched for these queries, as :data:`ROWS_ATTENTION` says."""
    if ROWS_ATTENTION not in ("auto", "loop", "batched"):
        raise ValueError(f"REVISIT_ROWS_ATTENTION is auto, loop or batched, not {ROWS_ATTENTION!r}")
    batched = ROWS_ATTENTION == "batched" or (ROWS_ATTENTION == "auto" and q.is_cuda)
    return attend_rows_batched if batched else attend_rows


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
        return rows_attention(q)(q, keys, values, self.sequences, active, scaling=layer.scaling, heads=heads,
                           kv_heads=kv_heads, hidden=self.hidden)

    def probs(self, layer, q: torch.Tensor, sequence: int, rows: torch.Tensor, columns: slice) -> torch.Tensor:
        """attention_probs for batch rows ``rows`` of one sequence (q: their queries), after this layer's call."""
        return attention_probs(q, self.pool.get_key_buffer(layer.layer_id), self.sequences.slots[sequence],
                               self.sequences.where[rows], columns, scaling=layer.scaling, heads=layer.tp_q_head_num)
