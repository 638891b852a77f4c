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

    approximate
           the alias entry's header is read before the forward, and the K/V of the plan's candidate tokens (its
           reuse set) start to be read, late layers only, sparse, never promoting the alias. The new image's own
           encoder output is used (SGLang's vision tower runs). The decoder runs layer by layer: the warmup layers
           [0, W) compute every row, and there the question's rows (those after the image) score each image token
           (engine_ext.selection); at layer W the selection decides R (computed on), B (the alias' K/V at their
           aligned tokens, keys turned per M-RoPE axis to this request's positions) and D (hidden from every
           query at layers >= W, here and in each later decode step of the request, which the executor then runs
           itself). Nothing computed this way is stored: it is not what a full prefill computes.

An exact or approximate plan whose entry is absent, damaged, or not this model's falls back to a full prefill (and
stores the entry); K/V blocks found damaged during the forward have their rows computed from that layer on
instead, which is what a full prefill computes for them. An approximate plan also falls back when its image and
question are not in one extend (chunked prefill) or its alias does not fit it. A request without a plan, or with
one that does not fit its images, runs exactly as in SGLang. Rows an earlier request left in the radix cache are
never touched (the gateway salts approximate requests' prefix cache per request, so none is ever left). What was
done is counted (executor.events).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine_ext import selection as select_
from engine_ext import vision
from engine_ext.executor.attention import PoolAttention
from engine_ext.executor.entries import EntryHead, KVFetch, KVGroup, StoredImage, read_head, to_entry
from engine_ext.executor.events import ExecutionEvents
from engine_ext.executor.rows import ImageRows, locate, reuse_depths
from engine_ext.rope import frequency_axes, inv_freq
from engine_ext.selection import ATTENTION, DEVIATION, score_kind
from plan import APPROXIMATE, EXACT, PARTIAL_PASS, SAME, ImagePlan, PlanError, RequestPlan, recompute_count

log = logging.getLogger(__name__)


@dataclass
class _ReuseSpan:
    """The image rows of one exact plan computed in this extend, and where their stored K/V come from."""

    rows: ImageRows
    depth: torch.Tensor  # (rows,) per batch row of the span: how many leading layers compute it
    groups: list[tuple[int, torch.Tensor, Future[KVGroup | None]]]  # (depth, rows of the span, its K/V)


@dataclass
class _ApproximateSpan:
    """One approximate plan's image in this extend, the question rows that score its tokens, the alias' K/V."""

    rows: ImageRows
    plan: ImagePlan
    sequence: int  # the request's sequence in the batch
    question: torch.Tensor  # batch rows after the image, up to the request's last row in this extend
    candidates: torch.Tensor  # image-local tokens whose alias K/V are read (the plan's reuse set), increasing
    first: int  # the first layer read: W, or 0 when layer 0's K/V score the tokens (cacheblend)
    future: Future[KVGroup | None] | None  # the read, until waited for
    kind: str | None  # what the selector ranks by (engine_ext.selection.score_kind)
    score: torch.Tensor  # (tokens,) float64, measured in the warmup
    group: KVGroup | None = None  # the read, once it arrived
    failed: bool = False


def _digest(tokens: torch.Tensor) -> str:
    """A short digest of a token set, for logs that a test compares with the reference's choice."""
    import hashlib

    return hashlib.blake2b(",".join(map(str, tokens.tolist())).encode(), digest_size=6).hexdigest()


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
        self._axes: torch.Tensor | None = None  # the M-RoPE axis of each rotary frequency, probed on first use
        # per request id: (W, prompt positions) of tokens an approximate prefill dropped; insertion-ordered, bounded
        self._hidden: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._composed: list[int] = []  # encoder-cache keys of this forward's composed encoder outputs

    # --- the store, opened on first use ---

    @property
    def store(self):
        with self._store_lock:
            if self._store is None:
                self._store = self._store_factory()
            return self._store

    # --- per forward ---

    def forward(self, input_ids: torch.Tensor, forward_batch, run_model: Callable[[], object]):
        if forward_batch.forward_mode.is_decode() and self._hidden and any(
                rid in self._hidden for rid in forward_batch.rids or ()):
            return self._decode_with_hidden(input_ids, forward_batch)
        if not forward_batch.forward_mode.is_extend() or not forward_batch.mm_inputs:
            return run_model()
        plans = self._plans(forward_batch.rids)
        if not plans:
            return run_model()
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        images = [(rows, plans[rows.rid].images[rows.index]) for rows in
                  locate(forward_batch, get_req_to_token_pool().req_to_token)
                  if rows.rid in plans and self._fits(rows, plans[rows.rid])]
        captures, reuse, approximate = [], [], []
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
            elif plan.strategy == APPROXIMATE and rows.in_extend:
                approximate_span = self._prepare_approximate(rows, plan, forward_batch)
                if approximate_span is not None:
                    approximate.append(approximate_span)
                    continue  # computed approximately: never stored
                self.events.add("approximate_fallback")
            elif rows.in_extend and rows.lo == rows.start:  # counted once, in the chunk that starts the image
                self.events.add("miss")
            if (plan.store or plan.strategy == EXACT) and rows.complete and self._first_capture(rows, plan):
                positions = rows.positions
                if positions is None and rows.whole_in_extend:
                    positions = forward_batch.mrope_positions[:, rows.batch_rows].clone()
                if positions is not None:
                    captures.append((rows, plan, positions))
        try:
            if reuse or approximate:
                out = self._forward_with_reuse(input_ids, forward_batch, reuse, approximate)
            else:
                out = run_model()
        finally:
            self._forget_composed()
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

    # --- approximate hits ---

    def _prepare_approximate(self, rows: ImageRows, plan: ImagePlan, forward_batch) -> _ApproximateSpan | None:
        """Check that the plan can run here; start reading the alias' K/V of its candidates. None: full prefill."""
        layers = len(self.layers)
        end = rows.batch_lo + rows.done - rows.lo  # the batch row after the request's last row in this extend
        question = torch.arange(rows.batch_lo + rows.tokens, end, device=rows.slots.device)
        if not rows.whole_in_extend or not len(question):
            log.info("revisit: approximate plan for %s needs its image and question in one extend; full prefill",
                     plan.key[:16])
            return None
        assert plan.alias is not None  # an approximate ImagePlan always names one
        alias_grid = plan.alias_grid or plan.grid
        partial = plan.vision == PARTIAL_PASS
        try:
            head = read_head(self.store, plan.alias, model_id=self.model_id, layers=layers, kv_heads=self.kv_heads,
                             head_dim=self.head_dim, tokens=alias_grid[0] * alias_grid[1], with_encoder=partial)
            axes = self._frequency_axes()
        except Exception:  # a store that cannot be read means a full prefill, never a failed request
            log.exception("revisit: preparing the approximate plan for %s failed", plan.key[:16])
            head = None
        if head is None:
            log.info("revisit: approximate plan for %s found no usable alias entry %s; full prefill", plan.key[:16],
                     plan.alias[:16])
            return None
        if partial:
            self._partial_vision_pass(rows, plan, head)
        kind = score_kind(plan)
        candidates = torch.tensor(plan.reuse, dtype=torch.long, device=question.device)
        first = 0 if kind == DEVIATION else plan.warmup_layers
        future = None
        if len(candidates) and first < layers:
            sources = torch.tensor([plan.alias_token(i) for i in plan.reuse], dtype=torch.long)
            now = forward_batch.mrope_positions[:, rows.batch_rows[candidates]]  # (3, candidates)
            deltas = now.cpu() - head.positions[:, sources]
            future = self._reader.fetch(self.store, plan.alias, tokens=sources.tolist(), depth=first, layers=layers,
                                        kv_dtype=head.kv_dtype, delta=deltas, frequencies=self.frequencies,
                                        device=question.device, axes=axes)
        return _ApproximateSpan(rows=rows, plan=plan, sequence=rows.request, question=question,
                                candidates=candidates, first=first, future=future, kind=kind,
                                score=torch.zeros(rows.tokens, dtype=torch.float64))

    def _partial_vision_pass(self, rows: ImageRows, plan: ImagePlan, head: EntryHead) -> None:
        """The new image's encoder output: the alias' stored one at aligned tokens, and the vision tower's over the
        tokens whose pixels differ (changed or similar) and their margin only (engine_ext.vision). Put where SGLang
        looks before running the tower, and taken out again after the forward (self._composed), so no later
        request mistakes it for the image's own. Anything that goes wrong leaves SGLang's full vision pass to run,
        and is counted."""
        from sglang.srt.managers import mm_schedule
        from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult

        cache = mm_schedule.embedding_cache
        if cache is None or cache.has(rows.item_hash):
            return  # SGLang holds the image's own encoder output: nothing to save
        try:
            item = rows.item
            h, w = plan.grid
            changed = torch.tensor([mark != SAME for mark in plan.change_map]).view(h, w)  # pixels differ
            visual = self.model.visual
            encode = vision.margin_tokens(changed, arch=self._arch(), window_tokens=vision.window_tokens_of(visual))
            tokens = encode.flatten().nonzero().flatten()
            assert head.encoder is not None  # read with the header for a partial pass
            alias_encoder = head.encoder
            sources = torch.tensor([-1 if (j := plan.alias_token(i)) is None else j for i in range(plan.tokens)])
            composed = alias_encoder.new_zeros(plan.tokens, alias_encoder.shape[-1])
            aligned = (sources >= 0).nonzero().flatten()
            composed[aligned] = alias_encoder[sources[aligned]]
            if len(tokens):
                embeds, deepstack = vision.encode_partial_sglang(visual, item.feature, item.image_grid_thw, tokens)
                composed[tokens] = torch.cat([embeds, *deepstack], dim=-1).to(composed.device, composed.dtype)
            if bool((~encode.flatten())[sources < 0].any()):
                raise ValueError("a token with no alias token lies outside the margin")
        except Exception:
            log.exception("revisit: the partial vision pass for %s failed; the full pass runs", plan.key[:16])
            self.events.add("vision_partial_failed")
            return
        if cache.set(rows.item_hash, EmbeddingResult(embedding=composed)):
            self._composed.append(rows.item_hash)
            self.events.add("vision_partial_images")
            self.events.add("vision_partial_tokens", len(tokens))
            log.info("revisit: partial vision pass for %s: %d of %d tokens encoded", plan.key[:16], len(tokens),
                     plan.tokens)

    def _arch(self) -> str:
        return getattr(self.model.config, "model_type", "")

    def _frequency_axes(self) -> torch.Tensor:
        """The M-RoPE axis of each rotary frequency, read off the model's own rotary embedding (probed once)."""
        if self._axes is None:
            rotary = self.layers[0].self_attn.rotary_emb
            half = self.head_dim // 2

            def sines(positions: torch.Tensor) -> torch.Tensor:
                rows = positions.shape[1]
                device = self.frequencies.device if self.frequencies.is_cuda else next(
                    self.model.parameters()).device
                q = torch.zeros(rows, self.head_dim, device=device)
                k = torch.cat([torch.ones(rows, half, device=device), torch.zeros(rows, half, device=device)], -1)
                _, turned = rotary(positions.to(device), q, k.clone())
                return turned.view(rows, -1)[:, half:].float().cpu()  # k's second half after RoPE: the sines

            self._axes = frequency_axes(sines, half)
        return self._axes

    def _score(self, span: _ApproximateSpan, layer: int, attention: PoolAttention, attn, q: torch.Tensor,
               active: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> None:
        """One warmup layer's measurement for the span's selector (engine_ext.selection)."""
        rows = span.rows
        image_rows = rows.batch_rows
        if span.kind == ATTENTION and layer < span.plan.warmup_layers:
            asking = torch.searchsorted(active, span.question)
            probs = attention.probs(attn, q[asking], span.sequence, span.question, slice(rows.start, rows.stop))
            values = v_all[image_rows].view(rows.tokens, self.kv_heads, -1)
            span.score += select_.attention_score(probs, values).to(span.score.device)
        elif span.kind == DEVIATION and layer == 0:
            span.group = self._wait(span)
            if span.group is None:
                return
            tokens = image_rows[span.candidates]
            span.score[span.candidates.cpu()] = select_.deviation_score(
                k_all[tokens], v_all[tokens], span.group.k[0], span.group.v[0]).cpu()

    def _wait(self, span: _ApproximateSpan) -> KVGroup | None:
        if span.group is not None or span.future is None:
            return span.group
        try:
            span.group = span.future.result()
        except Exception:
            log.exception("revisit: reading the alias' K/V failed")
            span.group = None
        span.future = None
        if span.group is None:
            span.failed = True
        return span.group

    def _select(self, span: _ApproximateSpan, depth: torch.Tensor, reused: _Reused, attention: PoolAttention) -> None:
        """At layer W: R, B and D from what the warmup measured; B's K/V handed to the layers, D hidden."""
        plan, rows = span.plan, span.rows
        warmup = plan.warmup_layers
        if span.kind == DEVIATION and self._wait(span) is None:
            log.warning("revisit: the alias K/V of %s could not be read; computing the image", plan.key[:16])
            self.events.add("approximate_fallback")
            return  # every row stays computed at every layer: a full prefill of the image
        chosen = select_.select(plan, span.score if span.kind is not None else None)
        image_rows = rows.batch_rows
        reuse = chosen.reuse.to(image_rows.device)
        if len(reuse):
            group = self._wait(span)
            if group is None:
                log.warning("revisit: the alias K/V of %s could not be read (damaged or gone); computing the image "
                            "in full", plan.key[:16])
                self.events.add("kv_read_failed", len(reuse))
                self.events.add("approximate_fallback")
                return  # nothing reused, nothing dropped: from here on a full prefill of the image
            picked = torch.searchsorted(span.candidates, reuse)
            reused.ready.append((image_rows[reuse], KVGroup(
                depth=span.first, tokens=tuple(group.tokens[i] for i in picked.tolist()),
                k=group.k[:, picked], v=group.v[:, picked])))
            depth[image_rows[reuse]] = warmup
        drop = chosen.drop.to(image_rows.device)
        if len(drop):
            depth[image_rows[drop]] = warmup
            hidden = attention.hidden[span.sequence]
            if hidden is None:
                hidden = torch.zeros(len(attention.sequences.slots[span.sequence]), dtype=torch.bool,
                                     device=image_rows.device)
            hidden[rows.start + drop] = True
            attention.hidden[span.sequence] = hidden
            self._remember_hidden(rows.rid, warmup, rows.start + drop)
        self.events.add("approximate_executed")
        self.events.add("approximate_rows_reused", len(reuse))
        self.events.add("approximate_rows_recomputed", len(chosen.recompute))
        self.events.add("approximate_rows_dropped", len(drop))
        log.info("revisit: approximate hit %s from %s (%s, %s): %s, recomputed %s", plan.key[:16],
                 plan.alias[:16] if plan.alias else "-", rows.rid[:40], plan.selector, chosen.summary(),
                 _digest(chosen.recompute))

    def _forget_composed(self) -> None:
        """Take the partial passes' composed encoder outputs out of SGLang's encoder cache (see above)."""
        if not self._composed:
            return
        from sglang.srt.managers import mm_schedule

        cache = mm_schedule.embedding_cache
        for item_hash in self._composed:
            if cache is not None:
                cache.free(item_hash, None)
        self._composed.clear()

    def _remember_hidden(self, rid: str, warmup: int, positions: torch.Tensor) -> None:
        """A request's dropped tokens stay hidden at layers >= W in every decode step after its prefill."""
        self._hidden.setdefault(rid, []).append((warmup, positions))
        while len(self._hidden) > 1024:
            self._hidden.pop(next(iter(self._hidden)))

    @torch.no_grad()
    def _forward_with_reuse(self, input_ids: torch.Tensor, forward_batch, spans: list[_ReuseSpan],
                            approximate: list[_ApproximateSpan]):
        """The decoder, layer by layer, computing each row only at the layers its depth gives it.

        Mirrors SGLang's Qwen2/Qwen3 decoder (residual adds, Qwen3's per-head q/k norms, Qwen3-VL's deepstack
        features added after the first layers), with one difference: rows are dropped from the computation as
        their depth runs out, and their stored K/V go to the KV pool instead (or, for an approximate plan's D,
        nothing: they are hidden). Attention is computed for the active rows' queries only (PoolAttention), so a
        reused row costs neither projections nor attention. Approximate spans decide their rows' depths at their
        layer W, from what the layers before it measured.
        """
        from sglang.srt.managers.mm_utils import prepare_mm_inputs

        model = self.model
        extra: dict = {}
        embeds = prepare_mm_inputs(input_ids, forward_batch, model.model, extra, model,
                                   use_deepstack=getattr(model, "use_deepstack", {}))
        deepstack = extra.get("input_deepstack_embeds")
        depth = torch.full((embeds.shape[0],), len(self.layers), device=embeds.device)  # (batch rows,)
        for span in spans:
            depth[span.rows.batch_rows] = span.depth
        reused = _Reused(spans, depth, len(self.layers), self.events)
        attention = PoolAttention(forward_batch)
        pending = list(approximate)

        def before(index: int) -> None:
            for span in [s for s in pending if s.plan.warmup_layers == index]:
                self._select(span, depth, reused, attention)
                pending.remove(span)
            reused.arrive(index)  # waits for the K/V first used at this layer; computes rows whose read failed

        def measure(index: int, attn, q, active, k_all, v_all) -> None:
            for span in pending:
                self._score(span, index, attention, attn, q, active, k_all, v_all)

        hidden = self._layers(embeds, forward_batch, attention, depth, deepstack=deepstack, before=before,
                              write=reused.write, measure=measure if pending else None)
        return model.logits_processor(input_ids, hidden, model.lm_head, forward_batch)

    @torch.no_grad()
    def _decode_with_hidden(self, input_ids: torch.Tensor, forward_batch):
        """A decode step for a batch holding requests whose approximate prefill dropped tokens: those tokens stay
        invisible at the layers that dropped them (SGLang's own decode attention cannot hide keys)."""
        model = self.model
        attention = PoolAttention(forward_batch)
        masks: list[tuple[int, int, torch.Tensor]] = []  # (sequence, from layer, hidden positions)
        for sequence, rid in enumerate(forward_batch.rids):
            for warmup, positions in self._hidden.get(rid, ()):
                masks.append((sequence, warmup, positions))
        self.events.add("decode_steps_hiding", len({m[0] for m in masks}))

        def before(index: int) -> None:
            for sequence, warmup, positions in masks:
                if warmup == index:
                    hidden = attention.hidden[sequence]
                    if hidden is None:
                        hidden = torch.zeros(len(attention.sequences.slots[sequence]), dtype=torch.bool,
                                             device=input_ids.device)
                    hidden[positions.to(hidden.device)] = True
                    attention.hidden[sequence] = hidden

        embeds = model.model.embed_tokens(input_ids)
        depth = torch.full((embeds.shape[0],), len(self.layers), device=embeds.device)
        hidden = self._layers(embeds, forward_batch, attention, depth, deepstack=None, before=before)
        return model.logits_processor(input_ids, hidden, model.lm_head, forward_batch)

    def _layers(self, embeds: torch.Tensor, forward_batch, attention: PoolAttention, depth: torch.Tensor, *,
                deepstack: torch.Tensor | None, before: Callable[[int], None],
                write: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                measure: Callable | None = None) -> torch.Tensor:
        """The decoder layers over a batch's rows, row i computed at layers < depth[i]; returns the final norm's
        output. ``before(layer)`` runs before each layer (it may lower depths), ``write`` puts reused rows' K/V in
        place, ``measure`` sees each layer's queries and K/V once attention has run."""
        model = self.model
        positions = forward_batch.mrope_positions
        hidden_size = embeds.shape[-1]
        rows_total = embeds.shape[0]
        deepstack_layers = 0 if deepstack is None else len(getattr(model.model, "deepstack_embed_to_decoder_layer", ()))
        hidden = embeds.clone()
        for index, layer in enumerate(self.layers):
            before(index)
            active = (depth > index).nonzero().flatten()
            attn = layer.self_attn
            x = hidden[active]
            q, k, v = _project(attn, positions[:, active], layer.input_layernorm(x))
            k_all, v_all = k.new_zeros(rows_total, attn.kv_size), v.new_zeros(rows_total, attn.kv_size)
            k_all[active], v_all[active] = k, v
            if write is not None:
                write(index, k_all, v_all)
            attended, _ = attn.o_proj(attention(attn.attn, q, k_all, v_all, active))
            if measure is not None:
                measure(index, attn.attn, q, active, k_all, v_all)
            x = x + attended
            x = x + layer.mlp(layer.post_attention_layernorm(x), forward_batch=forward_batch)
            if deepstack is not None and index < deepstack_layers:
                x = x + deepstack[active, index * hidden_size : (index + 1) * hidden_size].to(x.dtype)
            hidden[active] = x
        return model.model.norm(hidden)

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
