"""Executing reuse plans inside an SGLang worker's model forward.

For each extend batch, the executor reads the plan each request carries in its id (plan.request) and, per image:

    miss   the normal forward runs; afterwards the image's K/V (all layers, from the KV pool), its encoder output
           and positions are written to the store (on a background thread) under the plan's key
    exact  the entry's header and encoder output are read before the forward (entries.read_head); the encoder output
           goes into SGLang's encoder cache so the vision tower is skipped; then the decoder runs layer by layer with
           each image row computed only at the layers the plan's ratios give it, and its stored K/V, moved to this
           request's positions, written into its pool slots at the others. Those K/V are read on a reader thread,
           row group by row group, only the rows and layers that are reused (entries.KVFetch), while the forward
           runs the layers before them (offline.reference is the ground truth for these semantics)

An exact plan whose entry is absent, damaged, or not this model's falls back to a full prefill (and stores the
entry); K/V blocks found damaged during the forward have their rows computed from that layer on instead, which is
what a full prefill computes for them. A request without a plan, or with one that does not fit its images, runs
exactly as in SGLang. Rows an earlier request left in the radix cache are never touched. Approximate plans are not
executed yet (full prefill). What was done is counted (executor.events).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine_ext.executor.attention import PoolAttention
from engine_ext.executor.entries import EntryHead, KVFetch, KVGroup, StoredImage, read_head, to_entry
from engine_ext.executor.events import ExecutionEvents
from engine_ext.executor.rows import ImageRows, locate, reuse_depths
from engine_ext.rope import inv_freq
from plan import EXACT, MISS, ImagePlan, PlanError, RequestPlan, recompute_count

log = logging.getLogger(__name__)


@dataclass
class _ReuseSpan:
    """The image rows of one exact plan computed in this extend, and where their stored K/V come from."""

    rows: ImageRows
    depth: torch.Tensor  # (rows,) per batch row of the span: how many leading layers compute it
    groups: list[tuple[int, torch.Tensor, Future[KVGroup | None]]]  # (depth, rows of the span, its K/V)


class PlanExecutor:
    """One per model instance (one per worker process); see the module docstring."""

    def __init__(self, model, *, model_id: str, store_factory: Callable[[], object] | None = None) -> None:
        self.model = model
        self.layers = model.model.layers
        self.model_id = model_id
        attn = self.layers[0].self_attn
        self.kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.frequencies = inv_freq(attn.rotary_emb.base, attn.rotary_emb.rotary_dim)
        self._store_factory = store_factory or _open_store
        self._store = None
        self._store_lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="revisit-store-writer")
        self._reader = KVFetch()
        self.events = ExecutionEvents()
        self._captured: dict[tuple[str, int], None] = {}  # insertion-ordered, bounded

    # --- the store, opened on first use ---

    @property
    def store(self):
        with self._store_lock:
            if self._store is None:
                self._store = self._store_factory()
            return self._store

    # --- per forward ---

    def forward(self, input_ids: torch.Tensor, forward_batch, run_model: Callable[[], object]):
        if not forward_batch.forward_mode.is_extend() or not forward_batch.mm_inputs:
            return run_model()
        plans = self._plans(forward_batch.rids)
        if not plans:
            return run_model()
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        images = [(rows, plans[rows.rid].images[rows.index]) for rows in
                  locate(forward_batch, get_req_to_token_pool().req_to_token)
                  if rows.rid in plans and self._fits(rows, plans[rows.rid])]
        captures, reuse = [], []
        for rows, plan in images:
            if plan.strategy == EXACT and rows.in_extend:
                span = self._prepare_reuse(rows, plan, forward_batch)
                if span is not None:
                    reuse.append(span)
                    continue
                self.events.add("exact_fallback")
            elif plan.strategy == EXACT:
                self.events.add("exact_served_by_prefix_cache")
                continue
            elif plan.strategy != MISS:
                self.events.add(f"{plan.strategy}_not_executed")
            elif rows.in_extend and rows.lo == rows.start:  # counted once, in the chunk that starts the image
                self.events.add("miss")
            if (plan.store or plan.strategy == EXACT) and rows.complete and self._first_capture(rows, plan):
                positions = rows.positions
                if positions is None and rows.whole_in_extend:
                    positions = forward_batch.mrope_positions[:, rows.batch_rows].clone()
                if positions is not None:
                    captures.append((rows, plan, positions))
        out = self._forward_with_reuse(input_ids, forward_batch, reuse) if reuse else run_model()
        for rows, plan, positions in captures:
            self._capture(rows, plan, positions)
        return out

    def _first_capture(self, rows: ImageRows, plan: ImagePlan) -> bool:
        """Once per request and image: a later chunk of the same request finds the image complete again."""
        mark = (rows.rid, rows.index)
        if mark in self._captured:
            return False
        self._captured[mark] = None
        while len(self._captured) > 4096:
            self._captured.pop(next(iter(self._captured)))
        return True

    def _plans(self, rids) -> dict[str, RequestPlan]:
        plans = {}
        for rid in rids or ():
            try:
                plan = RequestPlan.from_rid(rid)
            except PlanError as exc:
                log.warning("revisit: ignoring the plan of %s: %s", str(rid)[:48], exc)
                self.events.add("plan_refused")
                continue
            if plan is not None:
                plans[rid] = plan
        return plans

    def _fits(self, rows: ImageRows, plan: RequestPlan) -> bool:
        if rows.index >= len(plan.images) or plan.images[rows.index].tokens != rows.tokens:
            log.warning("revisit: plan of %s does not match its image %d (%d tokens); running it unplanned",
                        rows.rid[:48], rows.index, rows.tokens)
            self.events.add("plan_mismatch")
            return False
        return True

    # --- exact hits ---

    def _prepare_reuse(self, rows: ImageRows, plan: ImagePlan, forward_batch) -> _ReuseSpan | None:
        """Read what must be known before the forward; start reading the K/V it will need. None: full prefill."""
        layers = len(self.layers)
        try:
            head = read_head(self.store, plan.key, model_id=self.model_id, layers=layers, kv_heads=self.kv_heads,
                             head_dim=self.head_dim, tokens=rows.tokens)
        except Exception:  # a store that cannot be read means a full prefill, never a failed request
            log.exception("revisit: reading %s failed", plan.key)
            head = None
        if head is None:
            log.info("revisit: exact plan for %s found no usable entry; full prefill", plan.key[:16])
            return None
        local = rows.local_rows
        now = forward_batch.mrope_positions[:, rows.batch_rows]  # (3, rows)
        shift = now - head.positions.to(now.device)[:, local]
        if not (shift == shift[0, 0]).all():
            log.warning("revisit: entry %s does not move as a whole to this prompt; full prefill", plan.key[:16])
            return None
        delta = int(shift[0, 0])
        self._cache_encoder_output(rows, head)
        counts = [recompute_count(r, rows.tokens) for r in (plan.ratios or (0.0,) * layers)]
        depth = reuse_depths(counts, local)  # (rows,)
        groups = []
        for d in sorted(set(depth.tolist()) - {layers}):  # rows computed at every layer read nothing
            members = (depth == d).nonzero().flatten()  # (group rows,) indices into the span
            future = self._reader.fetch(self.store, plan.key, tokens=local[members].tolist(), depth=d, layers=layers,
                                        kv_dtype=head.kv_dtype, delta=delta, frequencies=self.frequencies,
                                        device=depth.device)
            groups.append((d, members, future))
        self.events.add("exact_executed")
        self.events.add("exact_rows_reused", int((depth < layers).sum()))
        log.info("revisit: exact hit %s (%s): %d image rows, moved by %d, recomputed per layer %s",
                 plan.key[:16], rows.rid[:40], len(local), delta, counts)
        return _ReuseSpan(rows=rows, depth=depth, groups=groups)

    def _cache_encoder_output(self, rows: ImageRows, head: EntryHead) -> None:
        """Put the stored encoder output where SGLang looks before running the vision tower."""
        from sglang.srt.managers import mm_schedule
        from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult

        cache = mm_schedule.embedding_cache
        if cache is not None and cache.set(rows.item_hash, EmbeddingResult(embedding=head.encoder)):
            self.events.add("encoder_from_store")

    @torch.no_grad()
    def _forward_with_reuse(self, input_ids: torch.Tensor, forward_batch, spans: list[_ReuseSpan]):
        """The decoder, layer by layer, computing each row only at the layers its depth gives it.

        Mirrors SGLang's Qwen2/Qwen3 decoder (residual adds, Qwen3's per-head q/k norms, Qwen3-VL's deepstack
        features added after the first layers), with one difference: rows are dropped from the computation as
        their depth runs out, and their stored K/V go to the KV pool instead. Attention is computed for the
        active rows' queries only (PoolAttention), so a reused row costs neither projections nor attention.
        """
        from sglang.srt.managers.mm_utils import prepare_mm_inputs

        model = self.model
        positions = forward_batch.mrope_positions
        extra: dict = {}
        embeds = prepare_mm_inputs(input_ids, forward_batch, model.model, extra, model,
                                   use_deepstack=getattr(model, "use_deepstack", {}))
        deepstack = extra.get("input_deepstack_embeds")
        deepstack_layers = 0 if deepstack is None else len(getattr(model.model, "deepstack_embed_to_decoder_layer", ()))
        hidden_size = embeds.shape[-1]
        rows_total = embeds.shape[0]
        depth = torch.full((rows_total,), len(self.layers), device=embeds.device)  # (batch rows,)
        for span in spans:
            depth[span.rows.batch_rows] = span.depth
        reused = _Reused(spans, depth, len(self.layers), self.events)
        attention = PoolAttention(forward_batch)
        hidden = embeds.clone()
        for index, layer in enumerate(self.layers):
            reused.arrive(index)  # waits for the K/V first used at this layer; computes rows whose read failed
            active = (depth > index).nonzero().flatten()
            attn = layer.self_attn
            x = hidden[active]
            q, k, v = _project(attn, positions[:, active], layer.input_layernorm(x))
            k_all, v_all = k.new_empty(rows_total, attn.kv_size), v.new_empty(rows_total, attn.kv_size)
            k_all[active], v_all[active] = k, v
            reused.write(index, k_all, v_all)
            attended, _ = attn.o_proj(attention(attn.attn, q, k_all, v_all, active))
            x = x + attended
            x = x + layer.mlp(layer.post_attention_layernorm(x), forward_batch=forward_batch)
            if deepstack is not None and index < deepstack_layers:
                x = x + deepstack[active, index * hidden_size : (index + 1) * hidden_size].to(x.dtype)
            hidden[active] = x
        hidden = model.model.norm(hidden)
        return model.logits_processor(input_ids, hidden, model.lm_head, forward_batch)

    # --- misses ---

    def _capture(self, rows: ImageRows, plan: ImagePlan, positions: torch.Tensor) -> None:
        """Copy the image's K/V out of the pool now; build and store the entry on the writer thread."""
        from sglang.srt.managers import mm_schedule
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        cache = mm_schedule.embedding_cache
        encoded = cache.get_single(rows.item_hash) if cache is not None else None
        if encoded is None:
            log.warning("revisit: encoder output of %s not in the encoder cache; not stored", plan.key[:16])
            self.events.add("capture_skipped")
            return
        pool = get_token_to_kv_pool()
        k = torch.stack([pool.get_key_buffer(i)[rows.slots] for i in range(len(self.layers))]).clone()
        v = torch.stack([pool.get_value_buffer(i)[rows.slots] for i in range(len(self.layers))]).clone()
        image = StoredImage(encoder=encoded.embedding.detach().clone(), positions=positions, k=k, v=v)
        self._writer.submit(self._write, plan, image)

    def _write(self, plan: ImagePlan, image: StoredImage) -> None:
        try:
            size = self.store.put(plan.key, to_entry(self.model_id, plan.grid, image, plan.prefix_digest))
        except Exception:
            log.exception("revisit: storing %s failed", plan.key)
            self.events.add("store_failed")
            return
        self.events.add("stored")
        log.info("revisit: stored %s (%d tokens, %d bytes)", plan.key[:16], image.tokens, size)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for pending store writes (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout)


class _Reused:
    """The stored K/V of every reuse span in a forward, handed to the layers that use them.

    A group's read is waited for at the first layer that needs it (its depth), so reads overlap the layers before
    it. A group whose read failed (its blocks damaged or gone since the header was read) has its rows computed from
    that layer on: their hidden states are current, since every layer before it computed them.
    """

    def __init__(self, spans: list[_ReuseSpan], depth: torch.Tensor, layers: int, events: ExecutionEvents) -> None:
        self.depth = depth  # (batch rows,), shared with the forward: raised for rows whose read failed
        self.layers = layers
        self.events = events
        self.pending = sorted(((d, span.rows.batch_rows[members], future) for span in spans
                               for d, members, future in span.groups), key=lambda group: group[0])
        self.ready: list[tuple[torch.Tensor, KVGroup]] = []  # (batch rows, K/V)

    def arrive(self, layer: int) -> None:
        while self.pending and self.pending[0][0] == layer:
            _, batch_rows, future = self.pending.pop(0)
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
                continue
            self.ready.append((batch_rows, group))

    def write(self, layer: int, k_all: torch.Tensor, v_all: torch.Tensor) -> None:
        """Put the stored K/V of this layer's reused rows into the layer's (batch rows, kv_size) K/V."""
        for batch_rows, group in self.ready:
            k_all[batch_rows] = group.k[layer - group.depth].to(k_all.dtype)
            v_all[batch_rows] = group.v[layer - group.depth].to(v_all.dtype)


def _project(attn, positions: torch.Tensor, h: torch.Tensor):
    """q, k (after RoPE) and v of some rows, as the layer's own attention computes them."""
    if hasattr(attn, "forward_prepare_native"):  # Qwen3: per-head q/k RMSNorm before RoPE
        return attn.forward_prepare_native(positions, h)
    qkv, _ = attn.qkv_proj(h)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = attn.rotary_emb(positions, q, k)
    return q, k, v


def _open_store():
    from store import StoreConfig, open_store

    return open_store(StoreConfig.from_env())
