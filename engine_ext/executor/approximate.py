"""Approximate hits in the worker: a new image computed from a similar stored one (its alias), as the plan says.

Before the forward (``ApproximateHits.prepare``): the alias entry's header is read, and the K/V of the plan's
candidate tokens (its reuse set) start to be read on the reader thread, late layers only, sparse, keys turned per
M-RoPE axis to this request's positions, never promoting the alias. With a partial vision pass the new image's
encoder output is composed from the alias' stored one and the vision tower's over only the tokens whose pixels
differ and their margin (engine_ext.vision); otherwise SGLang's vision tower runs over the whole image.

During it: the warmup layers [0, W) compute every row, and there the question's rows (those after the image)
score each image token (``score``, engine_ext.selection; under chunked prefill, where the image and its question
are not all in one extend, every extend of the image ranks without the question, so all decide the same sets); at
layer W (``select``) the selection decides R (computed on), B (the alias' K/V, handed to the layers through
exact.ReusedKV) and D (hidden from every query at layers >= W, here, in the request's later extends and in each of
its decode steps: ``hidden_in``). What was computed this way is not what a full prefill computes: it is stored
only as a derived entry (the executor's ``_derivable``), and only where nothing was dropped (``dropped``).
Whatever cannot run as planned runs as a full prefill of the image, and is counted.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine_ext import selection as select_
from engine_ext import vision
from engine_ext.executor.attention import PoolAttention
from engine_ext.executor.context import Context
from engine_ext.executor.entries import EntryHead, KVGroup
from engine_ext.executor.events import FullPrefill
from engine_ext.executor.exact import agreed_head
from engine_ext.executor.reused import ReusedKV
from engine_ext.executor.rows import ImageRows
from engine_ext.rope import frequency_axes
from engine_ext.selection import ATTENTION, DEVIATION, score_kind
from plan import APPROXIMATE, PARTIAL_PASS, SAME, ImagePlan
from plan.outcome import PLANNED, Outcome

log = logging.getLogger(__name__)


@dataclass
class ApproximateSpan:
    """One approximate plan's image in this extend, the question rows that score its tokens, the alias' K/V."""

    rows: ImageRows
    plan: ImagePlan
    sequence: int  # the request's sequence in the batch
    question: torch.Tensor  # batch rows after the image, up to the request's last row in this extend
    asks: bool  # the whole image and some question rows are in this extend (else ranked without the question)
    candidates: torch.Tensor  # image-local tokens of this extend whose alias K/V are read (selection.candidates)
    first: int  # the first layer read: W, or 0 when layer 0's K/V score the tokens (cacheblend)
    future: Future[KVGroup | None] | None  # the read, until waited for
    kind: str | None  # what the selector ranks by (engine_ext.selection.score_kind)
    score: torch.Tensor  # (tokens,) float64, measured in the warmup
    group: KVGroup | None = None  # the read, once it arrived
    failed: bool = False


class ApproximateHits:
    """One per PlanExecutor: the approximate spans' preparation and selection, and what outlives a forward (the
    tokens each request's prefill dropped, the encoder outputs a partial pass put in SGLang's cache)."""

    def __init__(self, context: Context, model) -> None:
        self.context = context
        self.model = model  # SGLang's model: its vision tower (partial passes) and rotary embedding (axes)
        self._axes: torch.Tensor | None = None  # the M-RoPE axis of each rotary frequency, probed on first use
        # per request id: (W, prompt positions) of tokens an approximate prefill dropped; insertion-ordered, bounded
        self._hidden: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._composed: list[int] = []  # encoder-cache keys of this forward's composed encoder outputs

    def hiding(self, rids) -> bool:
        """Whether a batch of these requests holds one whose prefill dropped tokens."""
        return bool(self._hidden) and any(rid in self._hidden for rid in rids or ())

    def dropped(self, rows: ImageRows) -> bool:
        """Whether the request's prefill dropped any of this image's tokens (in any of its extends so far)."""
        return any(bool(((positions >= rows.start) & (positions < rows.stop)).any())
                   for _, positions in self._hidden.get(rows.rid, ()))

    def hidden_in(self, rids) -> list[tuple[int, int, torch.Tensor]]:
        """(sequence, from layer, prompt positions) of each request's dropped tokens, for a decode step."""
        return [(sequence, warmup, positions) for sequence, rid in enumerate(rids)
                for warmup, positions in self._hidden.get(rid, ())]

    def prepare(self, rows: ImageRows, plan: ImagePlan, forward_batch) -> ApproximateSpan:
        """Check that the plan can run here; start reading the alias' K/V of its candidates. Raises FullPrefill."""
        layers = self.context.shape.layers
        device = rows.slots.device
        end = rows.batch_lo + rows.done - rows.lo  # the batch row after the request's last row in this extend
        after_image = rows.batch_lo + rows.stop - rows.lo  # the batch row of the image's end, if in this extend
        question = torch.arange(after_image if rows.hi == rows.stop else end, end, device=device)
        # Under chunked prefill the image's rows and its question may lie in different extends: each chunk of the
        # image then decides the same sets without the question (engine_ext.selection), and applies its own rows.
        asks = rows.whole_in_extend and len(question) > 0
        kind = score_kind(plan, question=asks)
        if kind == DEVIATION and not rows.whole_in_extend:
            raise FullPrefill("chunked", f"{plan.selector} ranks the whole image of {plan.key[:16]} at layer 0, "
                                         "and its rows are in several extends")
        assert plan.alias is not None  # an approximate ImagePlan always names one
        alias_grid = plan.alias_grid or plan.grid
        partial = plan.vision == PARTIAL_PASS
        context = self.context
        head = agreed_head(context, plan.alias, tokens=alias_grid[0] * alias_grid[1], with_encoder=partial)
        axes = self.frequency_axes()
        if partial:
            self._partial_vision_pass(rows, plan, head)
        here = range(rows.lo - rows.start, rows.hi - rows.start)  # the image's tokens computed in this extend
        candidates = torch.tensor([i for i in select_.candidates(plan, question=asks) if i in here],
                                  dtype=torch.long, device=device)
        first = 0 if kind == DEVIATION else plan.warmup_layers
        future = None
        if len(candidates) and first < layers:
            sources = torch.tensor([plan.alias_token(i) for i in candidates.tolist()], dtype=torch.long)
            now = forward_batch.mrope_positions[:, rows.batch_rows_of(candidates)]  # (3, candidates)
            deltas = now.cpu() - head.positions[:, sources]
            future = context.reader.fetch(context.store, plan.alias, tokens=sources.tolist(), depth=first,
                                          layers=layers, kv_dtype=head.kv_dtype, delta=deltas,
                                          frequencies=context.shape.frequencies, device=question.device, axes=axes,
                                          heads=context.tp.read_heads)
        return ApproximateSpan(rows=rows, plan=plan, sequence=rows.request, question=question, asks=asks,
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
        composed, tokens = None, torch.empty(0)
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
            built = alias_encoder.new_zeros(plan.tokens, alias_encoder.shape[-1])
            aligned = (sources >= 0).nonzero().flatten()
            built[aligned] = alias_encoder[sources[aligned]]
            if len(tokens):
                embeds, deepstack = vision.encode_partial_sglang(visual, item.feature, item.image_grid_thw, tokens)
                built[tokens] = torch.cat([embeds, *deepstack], dim=-1).to(built.device, built.dtype)
            if bool((~encode.flatten())[sources < 0].any()):
                raise ValueError("a token with no alias token lies outside the margin")
            composed = built
        except Exception:
            log.exception("revisit: the partial vision pass for %s failed; the full pass runs", plan.key[:16])
        if not self.context.tp.agree(composed is not None):  # every rank's vision tower runs the same pass
            self.context.events.add("vision_partial_failed")
            self.context.events.fallback(APPROXIMATE, "vision_partial_failed")
            self.context.ran.record(rows.rid, rows.index, Outcome(PLANNED, "vision_partial_failed"))
            return
        if cache.set(rows.item_hash, EmbeddingResult(embedding=composed)):
            self._composed.append(rows.item_hash)
            self.context.events.add("vision_partial_images")
            self.context.events.add("vision_partial_tokens", len(tokens))
            log.info("revisit: partial vision pass for %s: %d of %d tokens encoded", plan.key[:16], len(tokens),
                     plan.tokens)

    def _arch(self) -> str:
        return getattr(self.model.config, "model_type", "")

    def frequency_axes(self) -> torch.Tensor:
        """The M-RoPE axis of each rotary frequency, read off the model's own rotary embedding (probed once)."""
        if self._axes is None:
            shape = self.context.shape
            rotary = self.model.model.layers[0].self_attn.rotary_emb
            half = shape.head_dim // 2

            def sines(positions: torch.Tensor) -> torch.Tensor:
                rows = positions.shape[1]
                device = shape.frequencies.device if shape.frequencies.is_cuda else next(
                    self.model.parameters()).device
                q = torch.zeros(rows, shape.head_dim, device=device)
                k = torch.cat([torch.ones(rows, half, device=device), torch.zeros(rows, half, device=device)], -1)
                _, turned = rotary(positions.to(device), q, k.clone())
                return turned.view(rows, -1)[:, half:].float().cpu()  # k's second half after RoPE: the sines

            self._axes = frequency_axes(sines, half)
        return self._axes

    def score(self, span: ApproximateSpan, layer: int, attention: PoolAttention, attn, q: torch.Tensor,
              active: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> None:
        """One warmup layer's measurement for the span's selector (engine_ext.selection)."""
        rows = span.rows
        image_rows = rows.batch_rows
        if span.kind == ATTENTION and layer < span.plan.warmup_layers:
            asking = torch.searchsorted(active, span.question)
            probs = attention.probs(attn, q[asking], span.sequence, span.question, slice(rows.start, rows.stop))
            values = v_all[image_rows].view(rows.tokens, -1, self.context.shape.head_dim)  # this rank's heads
            span.score += select_.attention_score(probs, values).to(span.score.device)
        elif span.kind == DEVIATION and layer == 0:
            span.group = self._wait(span)
            if span.group is None:
                return
            tokens = rows.batch_rows_of(span.candidates)
            span.score[span.candidates.cpu()] = select_.deviation_score(
                k_all[tokens], v_all[tokens], span.group.k[0], span.group.v[0]).cpu()

    def _wait(self, span: ApproximateSpan) -> KVGroup | None:
        if span.group is not None or span.future is None:
            return span.group
        try:
            span.group = span.future.result()
            if span.group is not None:
                span.group.wait()
        except Exception:
            log.exception("revisit: reading the alias' K/V failed")
            span.group = None
        span.future = None
        if not self.context.tp.agree(span.group is not None):  # a rank that could not read its heads
            span.group = None
            span.failed = True
        return span.group

    def select(self, span: ApproximateSpan, depth: torch.Tensor, reused: ReusedKV, attention: PoolAttention) -> None:
        """At layer W: R, B and D from what the warmup measured; B's K/V handed to the layers, D hidden."""
        plan, rows = span.plan, span.rows
        warmup = plan.warmup_layers
        if span.kind == DEVIATION and self._wait(span) is None:
            self.context.ran.fell_back(rows, plan, FullPrefill("kv_read_failed", "the alias' layer-0 K/V"))
            return  # every row stays computed at every layer: a full prefill of the image
        if span.kind is not None:  # each rank scored with its own attention heads
            span.score = self.context.tp.total(span.score)
        chosen = select_.select(plan, span.score if span.kind is not None else None, question=span.asks)
        device = rows.slots.device
        here = rows.lo - rows.start, rows.hi - rows.start  # the image's tokens computed in this extend

        def in_extend(tokens: torch.Tensor) -> torch.Tensor:
            return tokens[(tokens >= here[0]) & (tokens < here[1])].to(device)

        reuse = in_extend(chosen.reuse)
        if len(reuse):
            group = self._wait(span)
            if group is None:
                self.context.events.add("kv_read_failed", len(reuse))
                self.context.ran.fell_back(rows, plan, FullPrefill("kv_read_failed", "the alias' K/V, damaged or gone"))
                return  # nothing reused, nothing dropped: from here on a full prefill of the image
            picked = torch.searchsorted(span.candidates, reuse)
            reused.add(rows.batch_rows_of(reuse), KVGroup(
                depth=span.first, tokens=tuple(group.tokens[i] for i in picked.tolist()),
                k=group.k[:, picked], v=group.v[:, picked]))
            depth[rows.batch_rows_of(reuse)] = warmup
        drop = in_extend(chosen.drop)
        if len(drop):
            depth[rows.batch_rows_of(drop)] = warmup
            self._remember_hidden(rows.rid, warmup, rows.start + drop)
        # this extend's drops, and those of the image's earlier chunks (their rows are in the pool, hidden)
        earlier = chosen.drop[chosen.drop < here[1]].to(device)
        if len(earlier):
            attention.hide(span.sequence, rows.start + earlier)
        if rows.lo == rows.start:  # counted once, in the extend that starts the image
            self.context.events.add("approximate_executed")
        self.context.events.add("approximate_rows_reused", len(reuse))
        self.context.events.add("approximate_rows_recomputed", len(in_extend(chosen.recompute)))
        self.context.events.add("approximate_rows_dropped", len(drop))
        log.info("revisit: approximate hit %s from %s (%s, %s%s): %s, recomputed %s", plan.key[:16],
                 plan.alias[:16] if plan.alias else "-", rows.rid[:40], plan.selector,
                 "" if span.asks else f", without the question, rows {rows.lo}-{rows.hi}", chosen.summary(),
                 tokens_digest(chosen.recompute))

    def forget_composed(self) -> None:
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


def tokens_digest(tokens: torch.Tensor) -> str:
    """A short digest of a token set, for logs that a test compares with the reference's choice."""
    return hashlib.blake2b(",".join(map(str, tokens.tolist())).encode(), digest_size=6).hexdigest()
