"""Exact hits in the worker: what is read before the forward, and the stored K/V handed to the layers during it.

Before the forward (``prepare``): the entry's header and encoder output are read (entries.read_head); the encoder
output goes into SGLang's encoder cache so the vision tower is skipped; each image row gets the number of leading
layers that compute it (the plan's ratios, rows.reuse_depths), and the K/V of the layers after that start to be
read on the reader thread, row group by row group, moved to this request's positions (entries.KVFetch).

During it (``ReusedKV``): each group is waited for at the first layer that uses it, so reads overlap the layers
before it, and its K/V are written in place of the rows' own. The approximate path hands its reuse set to the same
``ReusedKV``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_ext.executor.entries import EntryHead, KVGroup, read_head
from engine_ext.executor.events import ExecutionEvents, FullPrefill, OutcomeLog
from engine_ext.executor.rows import ImageRows, reuse_depths
from plan import EXACT, ImagePlan, recompute_count
from plan.outcome import PLANNED, Outcome

if TYPE_CHECKING:
    from engine_ext.executor.executor import PlanExecutor

log = logging.getLogger(__name__)


@dataclass
class ReuseSpan:
    """The image rows of one exact plan computed in this extend, and where their stored K/V come from."""

    rows: ImageRows
    depth: torch.Tensor  # (rows,) per batch row of the span: how many leading layers compute it
    groups: list[tuple[int, torch.Tensor, Future[KVGroup | None]]]  # (depth, rows of the span, its K/V)


def prepare(worker: PlanExecutor, rows: ImageRows, plan: ImagePlan, forward_batch) -> ReuseSpan:
    """Read what must be known before the forward; start reading the K/V it will need. Raises FullPrefill."""
    layers = len(worker.layers)
    try:
        head = read_head(worker.store, plan.key, model_id=worker.model_id, layers=layers, kv_heads=worker.kv_heads,
                         head_dim=worker.head_dim, tokens=rows.tokens)
    except FullPrefill:
        raise
    except Exception as exc:  # a store that cannot be read means a full prefill, never a failed request
        log.exception("revisit: reading %s failed", plan.key)
        raise FullPrefill("store_error", str(exc)) from exc
    worker.events.add("store_bytes_read", head.nbytes)
    local = rows.local_rows
    now = forward_batch.mrope_positions[:, rows.batch_rows]  # (3, rows)
    shift = now - head.positions.to(now.device)[:, local]
    if not (shift == shift[0, 0]).all():
        raise FullPrefill("not_movable", f"entry {plan.key[:16]} does not move as a whole to this prompt")
    delta = int(shift[0, 0])
    cache_encoder_output(rows, head, worker.events)
    counts = [recompute_count(r, rows.tokens) for r in (plan.ratios or (0.0,) * layers)]
    depth = reuse_depths(counts, local)  # (rows,)
    groups = []
    for d in sorted(set(depth.tolist()) - {layers}):  # rows computed at every layer read nothing
        members = (depth == d).nonzero().flatten()  # (group rows,) indices into the span
        future = worker.reader.fetch(worker.store, plan.key, tokens=local[members].tolist(), depth=d, layers=layers,
                                     kv_dtype=head.kv_dtype, delta=delta, frequencies=worker.frequencies,
                                     device=depth.device)
        groups.append((d, members, future))
    worker.events.add("exact_executed")
    worker.events.add("exact_rows_reused", int((depth < layers).sum()))
    log.info("revisit: exact hit %s (%s): %d image rows, moved by %d, recomputed per layer %s",
             plan.key[:16], rows.rid[:40], len(local), delta, counts)
    return ReuseSpan(rows=rows, depth=depth, groups=groups)


def cache_encoder_output(rows: ImageRows, head: EntryHead, events: ExecutionEvents) -> None:
    """Put the stored encoder output where SGLang looks before running the vision tower."""
    from sglang.srt.managers import mm_schedule
    from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult

    cache = mm_schedule.embedding_cache
    if cache is not None and cache.set(rows.item_hash, EmbeddingResult(embedding=head.encoder)):
        events.add("encoder_from_store")


class ReusedKV:
    """The stored K/V of every reuse span in a forward, handed to the layers that use them.

    A group's read is waited for at the first layer that needs it (its depth), so reads overlap the layers before
    it. A group whose read failed (its blocks damaged or gone since the header was read) has its rows computed from
    that layer on: their hidden states are current, since every layer before it computed them.
    """

    def __init__(self, spans: list[ReuseSpan], depth: torch.Tensor, layers: int, events: ExecutionEvents,
                 ran: OutcomeLog) -> None:
        self.depth = depth  # (batch rows,), shared with the forward: raised for rows whose read failed
        self.layers = layers
        self.events = events
        self.ran = ran
        self.pending = sorted(((d, span.rows, span.rows.batch_rows[members], future) for span in spans
                               for d, members, future in span.groups), key=lambda group: group[0])
        self.ready: list[tuple[torch.Tensor, KVGroup]] = []  # (batch rows, K/V)

    def arrive(self, layer: int) -> None:
        while self.pending and self.pending[0][0] == layer:
            _, rows, batch_rows, future = self.pending.pop(0)
            try:
                group = future.result()
            except Exception:
                log.exception("revisit: reading stored K/V failed; computing those rows")
                group = None
            if group is None:
                log.warning("revisit: stored K/V of %d image rows could not be read (damaged or gone); computing "
                            "them from layer %d on", len(batch_rows), layer)
                self.depth[batch_rows] = self.layers
                self.events.add("kv_read_failed", len(batch_rows))
                self.events.fallback(EXACT, "kv_read_failed")
                self.ran.record(rows.rid, rows.index, Outcome(PLANNED, "kv_read_failed"))
                continue
            self.ready.append((batch_rows, group))

    def write(self, layer: int, k_all: torch.Tensor, v_all: torch.Tensor) -> None:
        """Put the stored K/V of this layer's reused rows into the layer's (batch rows, kv_size) K/V."""
        for batch_rows, group in self.ready:
            k_all[batch_rows] = group.k[layer - group.depth].to(k_all.dtype)
            v_all[batch_rows] = group.v[layer - group.depth].to(v_all.dtype)
