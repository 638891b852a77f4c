"""Exact hits in the worker: what is read before the forward, and the stored K/V handed to the layers during it.

Before the forward (``prepare``): the entry's header and encoder output are read (entries.read_head); the encoder
output goes into SGLang's encoder cache so the vision tower is skipped; each image row gets the number of leading
layers that compute it (the plan's ratios, rows.reuse_depths), and the K/V of the layers after that start to be
read on the reader thread, row group by row group, moved to this request's positions (entries.KVFetch).

During it: executor.reused.ReusedKV waits for each group at the first layer that uses it, so reads overlap the
layers before it, and writes its K/V in place of the rows' own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine_ext.executor.context import Context
from engine_ext.executor.entries import EntryHead, read_head
from engine_ext.executor.events import ExecutionEvents, FullPrefill
from engine_ext.executor.reused import ReuseSpan
from engine_ext.executor.rows import ImageRows, reuse_depths
from plan import ImagePlan, recompute_count

log = logging.getLogger(__name__)


def prepare(context: Context, rows: ImageRows, plan: ImagePlan, forward_batch,
            axes: Callable[[], torch.Tensor] | None = None) -> ReuseSpan:
    """Read what must be known before the forward; start reading the K/V it will need. Raises FullPrefill.

    An image moves as a whole (one step on every M-RoPE axis). A video's temporal patch may also move in time
    alone (a later window's patch of the same two frames): its keys are turned per axis (``axes``, the M-RoPE axis
    of each rotary frequency), and its encoder output is left to the vision tower, which SGLang runs over the whole
    video (a patch's tokens are encoded with every other patch's: the stored output is not this video's)."""
    shape = context.shape
    head = agreed_head(context, plan.key, tokens=rows.tokens, with_encoder=rows.patch is None)
    local = rows.local_rows
    now = forward_batch.mrope_positions[:, rows.batch_rows]  # (3, rows)
    shift = now - head.positions.to(now.device)[:, local]
    delta: int | torch.Tensor
    turned = None
    if bool((shift == shift[0, 0]).all()):
        delta = int(shift[0, 0])
    elif rows.patch is not None and axes is not None and bool((shift == shift[:, :1]).all()):
        delta, turned = shift.cpu(), axes()  # (3, rows): one step per axis, the same for every token
    else:
        raise FullPrefill("not_movable", f"entry {plan.key[:16]} does not move as a whole to this prompt")
    if rows.patch is None:
        cache_encoder_output(rows, head, context.events)
    counts = [recompute_count(r, rows.tokens) for r in (plan.ratios or (0.0,) * shape.layers)]
    depth = reuse_depths(counts, local)  # (rows,)
    groups = []
    for d in sorted(set(depth.tolist()) - {shape.layers}):  # rows computed at every layer read nothing
        members = (depth == d).nonzero().flatten()  # (group rows,) indices into the span
        moved = delta if turned is None else delta[:, members.cpu()]  # type: ignore[index]
        future = context.reader.fetch(context.store, plan.key, tokens=local[members].tolist(), depth=d,
                                      layers=shape.layers, kv_dtype=head.kv_dtype, delta=moved,
                                      frequencies=shape.frequencies, device=depth.device, axes=turned,
                                      heads=context.tp.read_heads)
        groups.append((d, members, future))
    context.events.add("exact_executed")
    context.events.add("exact_rows_reused", int((depth < shape.layers).sum()))
    moved_by = delta if turned is None else tuple(int(step) for step in shift[:, 0])
    log.info("revisit: exact hit %s (%s): %d %s rows, moved by %s, recomputed per layer %s", plan.key[:16],
             rows.rid[:40], len(local), "image" if rows.patch is None else "video patch", moved_by, counts)
    identical = isinstance(delta, int) and delta == 0 and not any(counts) and not head.derived and \
        bool(plan.prefix_digest) and head.prefix_digest == plan.prefix_digest
    return ReuseSpan(rows=rows, depth=depth, groups=groups, identical=identical)


def agreed_head(context: Context, key: str, *, tokens: int, with_encoder: bool = True) -> EntryHead:
    """entries.read_head of this model's entry under key, or FullPrefill; under tensor parallelism the same on
    every rank (a rank that could not read it makes every rank fall back, for its cause)."""
    shape = context.shape
    head, failure = None, None
    try:
        head = read_head(context.store, key, model_id=shape.model_id, layers=shape.layers, kv_heads=shape.kv_heads,
                         head_dim=shape.head_dim, tokens=tokens, with_encoder=with_encoder)
    except FullPrefill as exc:
        failure = exc
    except Exception as exc:  # a store that cannot be read means a full prefill, never a failed request
        log.exception("revisit: reading %s failed", key)
        failure = FullPrefill("store_error", str(exc))
    cause = context.tp.agree_cause(failure.cause if failure is not None else None)
    if cause is not None:
        if failure is not None and failure.cause == cause:
            raise failure
        raise FullPrefill(cause, f"{key[:16]}: another tensor-parallel rank's read")
    assert head is not None
    context.events.add("store_bytes_read", head.nbytes)
    return head


def cache_encoder_output(rows: ImageRows, head: EntryHead, events: ExecutionEvents) -> None:
    """Put the stored encoder output where SGLang looks before running the vision tower."""
    from sglang.srt.managers import mm_schedule
    from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult

    cache = mm_schedule.embedding_cache
    if cache is not None and cache.set(rows.item_hash, EmbeddingResult(embedding=head.encoder)):
        events.add("encoder_from_store")
