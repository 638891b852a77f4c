"""Executing reuse plans inside an SGLang worker's model forward.

For each extend batch, the executor reads the plan each request carries in its id (plan.request) and, per image:

    miss   the normal forward runs; afterwards the image's K/V (all layers, from the KV pool), its encoder output
           and positions are written to the store (on a background thread) under the plan's key
    exact  the stored entry's encoder output replaces the vision tower, and its K/V, moved to this request's
           positions, replace each image row's own at the layers the plan's ratios reuse it (executor.exact)
    approximate
           a similar stored image (the alias) stands in for the new one: the warmup layers [0, W) compute every
           row and score the image tokens by the question's attention; at layer W the plan's selector decides R
           (computed on), B (the alias' K/V, keys turned per M-RoPE axis) and D (hidden from every query at layers
           >= W, in prefill and in each decode step, which the executor then runs itself); with a partial vision
           pass the tower runs over only the tokens whose pixels differ (executor.approximate). With the plan's
           ``derive``, and where nothing was dropped, the K/V the request attended to (and the encoder output it
           was computed from) are stored as a derived entry naming the alias, so the image's next sight is exact.

The decoder of a forward with reused rows runs here, layer by layer (``_layers``, shared by exact, approximate and
decode steps), each row computed only at the layers its depth gives it (offline.reference is the ground truth for
these semantics).

An exact or approximate plan whose entry is absent, damaged, or not this model's falls back to a full prefill (and
stores the entry); K/V blocks found damaged during the forward have their rows computed from that layer on
instead, which is what a full prefill computes for them. An approximate plan also falls back when its alias does
not fit it, or when it ranks by layer-0 deviation (cacheblend) and its image is split over extends.

Chunked prefill (SGLang splits a long prompt into extends of at most --chunked-prefill-size rows): each extend
executes the plan for the image rows it holds. An exact plan's rows read their stored K/V per extend, moved as the
whole image moves; an extend of only reused rows computes nothing at the layers they reuse. An approximate plan
decides the same R, B and D in every extend of its image (an image split over extends, without the question:
engine_ext.selection), and the tokens dropped in one extend stay hidden in the later extends and the decode steps
of the request.

A video's temporal patches (the plan's ``patches``, executor.rows) run as images do, each under its own plan, with
two differences: SGLang's vision tower runs over the whole video whatever the plans (it encodes a video in one
pass, so no stored encoder output stands in for a patch's), and an exact patch may move in time alone (a later
window's patch of the same two frames), its keys turned per M-RoPE axis. A miss stores each patch's slice of the
video's encoder output with its K/V.

A request without a plan, or with one that does not fit its images, runs exactly as in SGLang. Rows an earlier
request left in the radix cache are never touched, and a request whose image K/V differ from a full prefill's (an
exact hit moved, recomputed or read from a derived entry; every approximate hit) leaves none there: the executor
marks it private, and SGLang's insert of its K/V is withheld (executor.prefix_cache). What was done is counted
(executor.events).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from engine_ext.executor import exact, prefix_cache
from engine_ext.executor.approximate import ApproximateHits, ApproximateSpan
from engine_ext.executor.attention import PoolAttention
from engine_ext.executor.context import Context, LazyStore, ModelShape, TensorParallel
from engine_ext.executor.entries import KVFetch, StoredImage, to_entry
from engine_ext.executor.events import ExecutionEvents, ForwardClock, FullPrefill, Marks, OutcomeLog
from engine_ext.executor.reused import ReusedKV, ReuseSpan
from engine_ext.executor.rows import ImageRows, locate
from engine_ext.rope import inv_freq
from plan import APPROXIMATE, EXACT, MISS, ImagePlan, PlanError, RequestPlan, plan_key
from plan.outcome import EVERY_IMAGE, PLANNED, PREFIX_CACHED, UNPLANNED, Outcome, Outcomes, outcome_box
from store import KVStore

log = logging.getLogger(__name__)


class PlanExecutor:
    """One per model instance (one per worker process); see the module docstring."""

    def __init__(self, model, *, model_id: str, store_factory: Callable[[], KVStore] | None = None,
                 outcomes_factory: Callable[[], Outcomes] | None = None, plan_key: bytes | None = None,
                 tp: TensorParallel | None = None) -> None:
        self.model = model
        # Plans are executed only when authenticated under the secret the gateway shares (plan/request.py).
        self.plan_key = plan_key if plan_key is not None else _plan_key()
        self.layers = model.model.layers
        attn = self.layers[0].self_attn
        kv_heads = getattr(attn, "total_num_kv_heads", attn.num_kv_heads)  # the model's; the pool holds the rank's
        tp = tp if tp is not None else TensorParallel.of_worker(kv_heads)
        if not tp.leader:  # the first rank logs what ran; the others only what goes wrong
            logging.getLogger("engine_ext").setLevel(logging.WARNING)
        events = ExecutionEvents(metrics=tp.leader)
        self.context = Context(
            shape=ModelShape(model_id=model_id, layers=len(self.layers), kv_heads=kv_heads, head_dim=attn.head_dim,
                             frequencies=inv_freq(attn.rotary_emb.base, attn.rotary_emb.rotary_dim)),
            tp=tp, stores=LazyStore(store_factory or _open_store), events=events,
            reader=KVFetch(on_read=lambda nbytes: events.add("store_bytes_read", nbytes)),
            ran=OutcomeLog(outcomes_factory or _open_outcomes, events, reports=tp.leader))
        self.events, self.ran = events, self.context.ran
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="revisit-store-writer")
        self.clock = ForwardClock()  # a forward in progress, for the gateway's health checks
        self._captured = Marks(4096)  # (request id, image) of the misses stored
        self._begun = Marks(4096)  # (request id, image) of the plans executed in an extend (chunked prefill)
        self._scoped = Marks(65536)  # item hashes keyed by their tenant's scope (_scope_items)
        self.approximate = ApproximateHits(self.context, model)
        self.private = prefix_cache.PRIVATE  # requests whose K/V SGLang's prefix cache must not keep
        prefix_cache.install(self.private)

    # --- per forward ---

    def keep_off_graph(self, forward_batch) -> None:
        """Before SGLang chooses between graph replay and its eager forward (which calls ``forward``): a decode
        batch holding a request whose approximate prefill dropped tokens must run ``_decode_with_hidden``, so it is
        marked the one way SGLang 0.5.23 keeps a decode batch off replay: an embedding override
        (``DecodeCudaGraphRunner.can_run_graph`` refuses a batch with ``replace_embeds``; the eager decode reads
        it nowhere). Other batches are left alone, to replay as SGLang decides."""
        if forward_batch.forward_mode.is_decode() and self.approximate.hiding(forward_batch.rids):
            forward_batch.replace_embeds = _OFF_GRAPH
            self.events.add("decode_kept_off_graph")

    def forward(self, input_ids: torch.Tensor, forward_batch, run_model: Callable[[], object]):
        self.clock.start()
        try:
            return self._forward(input_ids, forward_batch, run_model)
        finally:
            self.clock.end()

    def _forward(self, input_ids: torch.Tensor, forward_batch, run_model: Callable[[], object]):
        hiding = self.approximate.hiding(forward_batch.rids)
        if forward_batch.forward_mode.is_decode() and hiding:
            return self._decode_with_hidden(input_ids, forward_batch)
        if not forward_batch.forward_mode.is_extend() or not (forward_batch.mm_inputs or hiding):
            return run_model()
        try:
            return self._extend(input_ids, forward_batch, run_model, hiding)
        finally:
            self.ran.flush()  # what ran, for the gateway (plan.outcome)

    def _extend(self, input_ids: torch.Tensor, forward_batch, run_model: Callable[[], object], hiding: bool):
        """``hiding``: a request of the batch had image tokens dropped by an earlier extend; they stay hidden here."""
        plans = self._plans(forward_batch.rids)
        _scope_items(forward_batch, plans, self._scoped)
        if not plans and not hiding:
            return run_model()
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        images = [(rows, plan) for rows in locate(forward_batch, get_req_to_token_pool().req_to_token)
                  if rows.rid in plans and (plan := self._fitting(rows, plans[rows.rid])) is not None]
        captures: list[tuple[ImageRows, ImagePlan, torch.Tensor, bool]] = []  # (rows, plan, positions, derived)
        reuse: list[ReuseSpan] = []
        approximate: list[ApproximateSpan] = []
        for rows, plan in images:
            try:
                if plan.kind in (EXACT, APPROXIMATE) and not rows.in_extend:
                    # rows computed before this extend: by an earlier chunk of this request, or by an earlier
                    # request that computed them as a full prefill does (no other leaves them in the prefix cache)
                    if (rows.rid, rows.index) not in self._begun:
                        self.events.add(f"{plan.kind}_served_by_prefix_cache")
                        self.ran.record(rows.rid, rows.index, Outcome(PREFIX_CACHED))
                    continue
                if plan.kind == EXACT:
                    exact_span = exact.prepare(self.context, rows, plan, forward_batch,
                                               axes=self.approximate.frequency_axes)
                    if not exact_span.identical:
                        self._keep_private(rows)
                    reuse.append(exact_span)
                    self._begun.add((rows.rid, rows.index))
                    self.ran.record(rows.rid, rows.index, Outcome(PLANNED))
                    continue
                if plan.kind == APPROXIMATE:
                    approximate.append(self.approximate.prepare(rows, plan, forward_batch))
                    self._keep_private(rows)
                    self._begun.add((rows.rid, rows.index))
                    self.ran.record(rows.rid, rows.index, Outcome(PLANNED))
                    continue  # computed approximately: stored after the forward, as derived, when it may be
            except FullPrefill as fallback:
                self.ran.fell_back(rows, plan, fallback)
            if plan.kind == MISS:
                self.ran.record(rows.rid, rows.index, Outcome(PLANNED))
                if rows.in_extend and rows.lo == rows.start:  # counted once, in the chunk that starts the image
                    self.events.add("miss")
            # once per request and image: a later chunk of the same request finds the image complete again
            if (plan.store or plan.kind == EXACT) and rows.complete and self._captured.add((rows.rid, rows.index)):
                self._will_capture(captures, rows, plan, forward_batch)
        try:
            if reuse or approximate or hiding:
                out = self._forward_with_reuse(input_ids, forward_batch, reuse, approximate)
            else:
                out = run_model()
            for span in approximate:  # after the forward (its selection), before its composed encoder output goes
                if self._derivable(span):
                    self._will_capture(captures, span.rows, span.plan, forward_batch, derived=True)
            for rows, plan, positions, derived in captures:
                self._capture(rows, plan, positions, derived=derived)
        finally:
            self.approximate.forget_composed()
        return out

    def _keep_private(self, rows: ImageRows) -> None:
        """The request's K/V differ from a full prefill's: SGLang's prefix cache must not keep them."""
        self.private.mark(rows.rid, exact_until=rows.start)
        self.events.add("kept_out_of_prefix_cache")

    def _will_capture(self, captures: list[tuple[ImageRows, ImagePlan, torch.Tensor, bool]], rows: ImageRows,
                      plan: ImagePlan, forward_batch, *, derived: bool = False) -> None:
        """Add the image to what is stored after the forward, where its positions are known."""
        positions = rows.positions
        if positions is None and rows.whole_in_extend:
            positions = forward_batch.mrope_positions[:, rows.batch_rows].clone()
        if positions is not None:
            captures.append((rows, plan, positions, derived))

    def _derivable(self, span: ApproximateSpan) -> bool:
        """Whether an approximate image's K/V are stored as a derived entry: the plan asks for it, the image is
        complete with this extend, and none of its tokens was dropped (a dropped token's K/V are hidden, not
        computed: an exact hit on them would attend to what the approximate hit did not)."""
        rows, plan = span.rows, span.plan
        if not plan.derive or not rows.complete or not self._captured.add((rows.rid, rows.index)):
            return False
        if self.approximate.dropped(rows):
            self.events.add("derive_skipped")
            return False
        return True

    def _plans(self, rids) -> dict[str, RequestPlan]:
        plans = {}
        for rid in rids or ():
            try:
                plan = RequestPlan.from_rid(rid, key=self.plan_key)
            except PlanError as exc:
                log.warning("revisit: ignoring the plan of %s: %s", str(rid)[:48], exc)
                self.events.add("plan_refused")
                self.ran.record(rid, EVERY_IMAGE, Outcome(UNPLANNED, "plan_refused"))
                continue
            if plan is not None:
                plans[rid] = plan
                if not plan.reported:
                    self.ran.mute(rid)
        return plans

    def _fitting(self, rows: ImageRows, plan: RequestPlan) -> ImagePlan | None:
        """The plan of the image (or video patch) at ``rows``; None, counted, where the plan has none that fits. A
        plan without patches plans no video: its videos run as in SGLang, unremarked."""
        if rows.patch is not None and not plan.patches:
            return None
        units, index = (plan.images, rows.index) if rows.patch is None else (plan.patches, rows.patch)
        if index < len(units) and units[index].tokens == rows.tokens:
            return units[index]
        log.warning("revisit: plan of %s does not match its %s %d (%d tokens); running it unplanned", rows.rid[:48],
                    "image" if rows.patch is None else "video patch", index, rows.tokens)
        self.events.add("plan_mismatch")
        self.ran.record(rows.rid, rows.index, Outcome(UNPLANNED, "plan_mismatch"))
        return None


    @torch.no_grad()
    def _forward_with_reuse(self, input_ids: torch.Tensor, forward_batch, spans: list[ReuseSpan],
                            approximate: list[ApproximateSpan]):
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
        reused = ReusedKV(spans, depth, self.context)
        attention = PoolAttention(forward_batch)
        pending = list(approximate)
        hidden = self.approximate.hidden_in(forward_batch.rids)  # dropped in earlier chunks of these requests

        def before(index: int) -> None:
            for sequence, warmup, positions in hidden:
                if warmup == index:
                    attention.hide(sequence, positions)
            for span in [s for s in pending if s.plan.warmup_layers == index]:
                self.approximate.select(span, depth, reused, attention)
                pending.remove(span)
            reused.arrive(index)  # waits for the K/V first used at this layer; computes rows whose read failed

        def measure(index: int, attn, q, active, k_all, v_all) -> None:
            for span in pending:
                self.approximate.score(span, index, attention, attn, q, active, k_all, v_all)

        out = self._layers(embeds, forward_batch, attention, depth, deepstack=deepstack, before=before,
                           write=reused.write, measure=measure if pending else None)
        return model.logits_processor(input_ids, out, model.lm_head, forward_batch)

    @torch.no_grad()
    def _decode_with_hidden(self, input_ids: torch.Tensor, forward_batch):
        """A decode step for a batch holding requests whose approximate prefill dropped tokens: those tokens stay
        invisible at the layers that dropped them (SGLang's own decode attention cannot hide keys)."""
        model = self.model
        attention = PoolAttention(forward_batch)
        masks = self.approximate.hidden_in(forward_batch.rids)  # (sequence, from layer, prompt positions)
        self.events.add("decode_steps_hiding", len({m[0] for m in masks}))

        def before(index: int) -> None:
            for sequence, warmup, positions in masks:
                if warmup == index:
                    attention.hide(sequence, positions)

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
        tp = self.context.tp
        for index, layer in enumerate(self.layers):
            before(index)
            active = (depth > index).nonzero().flatten()
            attn = layer.self_attn
            x = hidden[active]
            if len(active):
                q, k, v = _project(attn, positions[:, active], layer.input_layernorm(x))
            else:  # every row reuses stored K/V from here on (an extend holding only an exact hit's image rows)
                q, k, v = x.new_empty(0, attn.q_size), x.new_empty(0, attn.kv_size), x.new_empty(0, attn.kv_size)
            k_all, v_all = k.new_zeros(rows_total, attn.kv_size), v.new_zeros(rows_total, attn.kv_size)
            k_all[active], v_all[active] = k, v
            if write is not None:
                write(index, k_all, v_all)
            attended = attention(attn.attn, q, k_all, v_all, active)  # writes every row's K/V to the pool
            if measure is not None:
                measure(index, attn.attn, q, active, k_all, v_all)
            if not len(active):
                continue
            # SGLang's layers leave the sums over tensor-parallel ranks to the layer boundaries, which this loop
            # replaces (o_proj and the MLP's down projection are built without reducing their results)
            x = x + tp.reduce(attn.o_proj(attended)[0])
            x = x + tp.reduce(layer.mlp(layer.post_attention_layernorm(x), forward_batch=forward_batch))
            if deepstack is not None and index < deepstack_layers:
                x = x + deepstack[active, index * hidden_size : (index + 1) * hidden_size].to(x.dtype)
            hidden[active] = x
        return model.model.norm(hidden)

    # --- misses ---

    def _capture(self, rows: ImageRows, plan: ImagePlan, positions: torch.Tensor, *, derived: bool = False) -> None:
        """Copy the image's K/V out of the pool now (every rank's heads, gathered); build and store the entry on
        the writer thread (the first rank's). ``derived``: the K/V were computed approximately (plan's alias)."""
        from sglang.srt.managers import mm_schedule
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        encoded = _encoder_output(mm_schedule.embedding_cache, rows)
        tp = self.context.tp
        if not tp.agree(encoded is not None):
            log.warning("revisit: encoder output of %s not in the encoder cache; not stored", plan.key[:16])
            self.events.add("capture_skipped")
            return
        assert encoded is not None
        pool = get_token_to_kv_pool()
        layers = range(len(self.layers))
        # (layers, tokens, this rank's heads, head_dim) -> every head, gathered from every rank
        k = tp.gather_heads(torch.stack([pool.get_key_buffer(i)[rows.slots] for i in layers])).clone()
        v = tp.gather_heads(torch.stack([pool.get_value_buffer(i)[rows.slots] for i in layers])).clone()
        if not tp.leader:
            return
        image = StoredImage(encoder=encoded.detach().clone(), positions=positions, k=k, v=v)
        copied = None
        if k.is_cuda:  # the copies run on SGLang's forward stream; the writer copies to the host on another
            copied = torch.cuda.Event()
            copied.record()
        self._writer.submit(self._write, plan, image, copied, derived)

    def _write(self, plan: ImagePlan, image: StoredImage, copied: torch.cuda.Event | None = None,
               derived: bool = False) -> None:
        if copied is not None:
            copied.synchronize()
        try:
            store = self.context.store
            entry = to_entry(self.context.shape.model_id, plan.grid, image, plan.prefix_digest, seal=store.seal,
                             derived_from=(plan.alias or "") if derived else "",
                             derivation=derivation(plan) if derived else "")
            size = store.put(plan.key, entry)
        except Exception:
            log.exception("revisit: storing %s failed", plan.key)
            self.events.add("store_failed")
            return
        self.events.add("derived_stored" if derived else "stored")
        log.info("revisit: stored %s%s (%d tokens, %d bytes)", plan.key[:16],
                 f" derived from {(plan.alias or '')[:16]}" if derived else "", image.tokens, size)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for pending store writes (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout)



# What keep_off_graph sets: a decode batch with an embedding override never replays a graph.
_OFF_GRAPH = torch.empty(0)


def _encoder_output(cache, rows: ImageRows) -> torch.Tensor | None:
    """The image's encoder output (a video patch's rows of it) as SGLang's encoder cache holds it: under the item's
    hash, or, for a video whose request SGLang encoded as one (items in several spans), under the combined hash of
    the request's video items (``MultiModalStaticCache.get``)."""
    if cache is None:
        return None
    found = cache.get_single(rows.item_hash)
    if rows.encoder_rows is None:
        return found.embedding if found is not None else None
    start, stop = rows.encoder_rows
    if found is None and rows.encoder_group:
        found = cache.get(list(rows.encoder_group))
        start, stop = start + rows.group_rows, stop + rows.group_rows
    if found is None or not isinstance(found.embedding, torch.Tensor) or found.embedding.shape[0] < stop:
        return None
    return found.embedding[start:stop]


def derivation(plan: ImagePlan) -> str:
    """What a derived entry records of the approximate plan that computed it."""
    return (f"selector={plan.selector};warmup={plan.warmup_layers};rho={plan.recompute_share:.4f};"
            f"reused={len(plan.reuse)}/{plan.tokens};vision={plan.vision};similarity={plan.similarity:.4f}")


def _scope_items(forward_batch, plans: dict[str, RequestPlan], scoped: Marks) -> None:
    """Key each image item of a request by its tenant's scope, once, before SGLang's encoder-output cache (and this
    executor) look it up: the same pixels sent by two namespaces are two entries there, so neither is served, or
    can time, the other's embeddings. The radix cache is kept apart by ``extra_key`` already. A request without an
    authenticated plan (its plan refused, or none: not the gateway's) is keyed by its own id: it shares nothing. An
    authenticated plan with no scope keeps SGLang's keys (the gateway scopes every request it plans).
    ``scoped`` holds the hashes already keyed so (an item comes back in each chunk of its request)."""
    for rid, mm in zip(forward_batch.rids or (), forward_batch.mm_inputs or (), strict=False):
        if mm is None:
            continue
        plan = plans.get(rid)
        if plan is not None and not plan.scope:
            continue  # an authenticated plan that shares its images' cache entries (no namespace asked for)
        scope = plan.scope if plan is not None else f"unscoped:{rid}"
        for item in mm.mm_items:
            if item.hash in scoped:
                continue
            digest = hashlib.blake2b(f"{scope}:{item.hash}".encode(), digest_size=8).digest()
            item.hash = int.from_bytes(digest, "big")  # SGLang masks it as it does its own
            scoped.add(item.hash)


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


def _plan_key() -> bytes:
    from settings.secret import DataPlaneSecret
    from store import StoreConfig

    return plan_key(DataPlaneSecret.read(StoreConfig.from_env().secret_file))


def _open_outcomes() -> Outcomes:
    from settings.secret import DataPlaneSecret
    from store import StoreConfig

    config = StoreConfig.from_env()
    # Outcomes through a Redis server are authenticated under the deployment secret the gateway shares; the
    # address carries the server's password, if any.
    return outcome_box(config.outcomes_path, config.outcomes_address, name=config.name,
                       secret=DataPlaneSecret.read(config.secret_file) if config.outcomes_url else None)
