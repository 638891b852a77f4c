"""The stored K/V of a forward's reused rows, handed to the layers that use them (exact hits, and an approximate
hit's B rows).

A row group's read is waited for at the first layer that needs it (its depth), so reads overlap the layers before
it. A group whose read failed (its blocks damaged or gone since the header was read) has its rows computed from
that layer on: their hidden states are current, since every layer before it computed them. Under tensor
parallelism every rank reads its own heads, so a read that failed on one rank is computed on all of them
(context.TensorParallel.agree).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine_ext.executor.context import Context
from engine_ext.executor.entries import KVGroup
from engine_ext.executor.rows import ImageRows
from plan import EXACT
from plan.outcome import PLANNED, Outcome

log = logging.getLogger(__name__)


@dataclass
class ReuseSpan:
    """The image rows of one exact plan computed in this extend, and where their stored K/V come from."""

    rows: ImageRows
    depth: torch.Tensor  # (rows,) per batch row of the span: how many leading layers compute it
    groups: list[tuple[int, torch.Tensor, Future[KVGroup | None]]]  # (depth, rows of the span, its K/V)
    # What a full prefill of this prompt computes: the entry was made after the same text, at the same positions,
    # exactly (not derived), and no layer recomputes a row from reused ones
    identical: bool = False


class ReusedKV:
    """Every reused row group of a forward: pending reads (``arrive``), then K/V written in place (``write``)."""

    def __init__(self, spans: list[ReuseSpan], depth: torch.Tensor, context: Context) -> None:
        self.depth = depth  # (batch rows,), shared with the forward: raised for rows whose read failed
        self.context = context
        self._pending = sorted(((d, span.rows, span.rows.batch_rows[members], future) for span in spans
                                for d, members, future in span.groups), key=lambda group: group[0])
        self._ready: list[tuple[torch.Tensor, KVGroup]] = []  # (batch rows, K/V)

    def add(self, batch_rows: torch.Tensor, group: KVGroup) -> None:
        """K/V already read (an approximate plan's B rows), used from group.depth on."""
        self._ready.append((batch_rows, group))

    def arrive(self, layer: int) -> None:
        """Wait for the groups first used at this layer; rows whose read failed on any rank are computed."""
        while self._pending and self._pending[0][0] == layer:
            _, rows, batch_rows, future = self._pending.pop(0)
            try:
                group = future.result()
                if group is not None:
                    group.wait()
            except Exception:
                log.exception("revisit: reading stored K/V failed; computing those rows")
                group = None
            if not self.context.tp.agree(group is not None):
                log.warning("revisit: stored K/V of %d image rows could not be read (damaged or gone); computing "
                            "them from layer %d on", len(batch_rows), layer)
                self.depth[batch_rows] = self.context.shape.layers
                self.context.events.add("kv_read_failed", len(batch_rows))
                self.context.events.fallback(EXACT, "kv_read_failed")
                self.context.ran.record(rows.rid, rows.index, Outcome(PLANNED, "kv_read_failed"))
                continue
            assert group is not None
            self._ready.append((batch_rows, group))

    def write(self, layer: int, k_all: torch.Tensor, v_all: torch.Tensor) -> None:
        """Put the stored K/V of this layer's reused rows into the layer's (batch rows, kv_size) K/V."""
        for batch_rows, group in self._ready:  # each arrived (or was added) at a layer >= its depth
            k_all[batch_rows] = group.k[layer - group.depth].to(k_all.dtype)
            v_all[batch_rows] = group.v[layer - group.depth].to(v_all.dtype)
