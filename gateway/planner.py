"""The planner: one plan per image of a request, from what the cache holds.

For each image (in prompt order), by its exact key, which already names the pixels, the model, the processor
settings and the tenant's namespace (so no plan ever names another tenant's entry):

    not in the store                  miss: full prefill, and the worker stores the entry
    stored after the same prefix      exact, nothing recomputed: the image sits at the same positions after the
                                      same tokens, so reusing its KV is identical to computing it
    stored after another prefix       exact, position-independent: keys moved, the first r_l of the image's tokens
                                      recomputed at layer l (the recompute profile's ratios, or a uniform ratio)
    not stored, but a near-duplicate  approximate: the matcher (gateway/matching) found a stored image of the same
    of a stored image                 namespace that it nearly duplicates; the plan names it as the alias, with the
                                      change map and the reuse set of the selector (gateway/matching/plans.py), or
                                      is a miss when the guard finds too much changed; content moved by part of a
                                      token is lined up again first (gateway/matching/moved.py)
    anything else                     miss

A plan is a prediction that it pays: with the workers' costs measured (gateway/calibration.py), an exact or
approximate plan predicted to take no less time than computing the image as plain SGLang does is not sent. The
image is computed instead: an approximate candidate as a miss (so it is stored, and its next sight is exact), an
exact one without storing (its entry is there). Such an image's header says ``refused=cost`` (REFUSALS).

A miss is indexed for approximate matching (its features persist beside the store): its entry is stored by its
worker. An image planned as approximate leaves a derived entry (its worker stores the K/V it computed, marked with
the alias: store.entry.EntryHeader.derived_from), so that its next sight is an exact hit; a derived entry is never
an alias (errors would compound), so such an image is not indexed. Without derived entries (``derive`` off), an
approximate image is indexed and stored only when its worker had to run it as a full prefill (its alias gone or
damaged: the KV is then exact); otherwise its index record, never backed by an entry, is dropped once the
pending grace has passed and a lookup finds it. Derived entries found by a lookup (from an older index) leave it.

The planner learns about entries from the store itself: a worker writes an entry after the miss that planned it,
recording the plan's prefix digest in it, and the next plan that finds it in the store admits it to the policy
(if the gateway's periodic pass over the store, Services._keep_books, has not already).
The digest is read back from the entry's header each time, so it always describes the bytes that are stored.
Entries the policy evicts leave the store; entries the store lost leave the books.

A video's temporal patches (with ``REVISIT_VIDEO_REUSE_PATCHES``) are planned as images are, each by its key (its
two frames' image keys): a miss stored by the worker, exact where the store holds the same two frames (moved in
time and place, with the profile's ratios: a patch's K/V attended to the patches before it), approximate where the
match index holds a near-duplicate patch or image. The vision tower still runs over the whole video (SGLang
encodes a video in one pass, every patch attending to the others), so a patch's plan pays only with what its
layers save (costs.pays ``tower_runs``); no derived entries.

Threading: the store and the books are read and changed on the cache thread (gateway/cache.py); the routing
memory below is the event loop's.

Cache-aware routing: the worker that last served an image is preferred for it (its own radix and encoder caches
may still hold it), unless it is busier than the least-loaded worker by more than ``affinity_slack``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gateway.books.errors import BooksError
from gateway.cache import CacheManager
from gateway.config import ReuseSettings
from gateway.costs import CostModel, pays, text_tokens
from gateway.images import CanonicalImage
from gateway.intake import IntakeResult
from gateway.matching.align import reported
from gateway.matching.matcher import Match, Matcher
from gateway.matching.moved import MovedImages
from gateway.matching.plans import approximate_plan, without_notes
from gateway.videos import FrameBook, FramesSeen, PatchBook, PatchesSeen, TemporalPatch
from plan import APPROXIMATE, EXACT, FULL_PASS, MISS, ImagePlan, RequestPlan
from plan.outcome import EVERY_IMAGE, PLANNED, PREFIX_CACHED, Outcome
from store import StoreError

if TYPE_CHECKING:
    from gateway.calibration import WorkerCosts

log = logging.getLogger(__name__)

_REMEMBERED = 65536  # holders of recent images


KINDS = ("miss", "exact_same_prefix", "exact_moved", "approximate")  # what each image was planned as
# Why an image that could have been reused was planned as a miss (Planned.refusals, the x-revisit-reuse header's
# ``refused=``, /admin/stats ``refused``, revisit_plan_refusals): the nearest stored image of its namespace was not
# similar enough; it was, but too much of it changed (the guard); the plan would have paid but not with the tokens
# that took notes of the changed ones recomputed too (the downstream selector's, gateway/matching/plans.py); the plan
# was predicted not to beat plain SGLang (an exact hit or an approximate one); the near-duplicates found had lost
# their entries.
REFUSALS = ("similarity", "changed_share", "notes", "cost", "alias_gone")
# What a request lets the planner reuse (the x-revisit-reuse-mode request header): everything, exact hits only, or
# nothing (plain SGLang; nothing is stored). A client can only ask for less than the gateway's settings allow.
REUSE_MODES = ("all", "exact", "off")
# Also counted: "admitted" (entries found in the store and taken into the books), "derived_hit" (exact plans whose
# entry is a derived one: an approximate hit's K/V), "store_unavailable" (requests planned nothing because the store
# or the shared books did not answer); refusals by reason apart (Planner.refused).


@dataclass(frozen=True)
class Refusal:
    """Why an image was planned as a miss though something stored was near it (REFUSALS), and how near:
    ``nearest`` is the best similarity among the namespace's stored images compared (1 for the image itself,
    stored, when its exact hit would not pay; rounded down, as an approximate plan's)."""

    reason: str
    nearest: float

    def header(self) -> str:
        return f"nearest={reported(self.nearest):.4f};refused={self.reason}"


@dataclass(frozen=True)
class Planned:
    plan: RequestPlan | None
    prefer: str | None  # worker URL to prefer, if any
    kinds: tuple[str, ...]  # per image, one of KINDS
    similarities: tuple[float | None, ...] = ()  # per image: an approximate plan's match score
    derived: tuple[bool, ...] = ()  # per image: an exact plan's entry is a derived one (an approximate hit's K/V)
    refusals: tuple[Refusal | None, ...] = ()  # per image planned as a miss: why, where something stored was near
    patch_kinds: tuple[tuple[str, ...], ...] = ()  # per video, per temporal patch: exact, approximate or miss

    def reuse_header(self, ran: Mapping[int, Outcome] | None = None) -> str:
        """Per image, what ran: ``miss``, ``exact_same_prefix``, ``exact_moved`` or ``approximate;similarity=0.9731``
        (rounded down: a near-duplicate never reads as 1) when the worker ran the plan; ``miss;nearest=0.8860;
        refused=similarity`` when something stored was near but not reused (Refusal); an exact kind with
        ``;derived`` when its entry holds an approximate hit's K/V, with ``;prefix_cached`` when SGLang's prefix
        cache held the image's rows already (nothing executed or read), with ``;degraded=<cause>``
        when some of it was computed instead; ``miss;planned=<kind>;fallback=<cause>`` when the worker had to
        compute the image as after a miss (plan.outcome.CAUSES). Without ``ran`` (the worker reported nothing),
        what was planned."""
        parts = []
        derived = self.derived or (False,) * len(self.kinds)
        refusals = self.refusals or (None,) * len(self.kinds)
        for index, (kind, similarity) in enumerate(zip(self.kinds, self.similarities or (None,) * len(self.kinds),
                                                       strict=True)):
            outcome = outcome_of(ran, index)
            if outcome is not None and outcome.fell_back:
                parts.append(f"miss;planned={kind};fallback={outcome.cause}")
                continue
            part = kind if similarity is None else f"{kind};similarity={similarity:.4f}"
            part += ";derived" if derived[index] else ""
            refusal = refusals[index]
            part += f";{refusal.header()}" if refusal is not None else ""
            part += ";prefix_cached" if outcome is not None and outcome.ran == PREFIX_CACHED else ""
            parts.append(part if outcome is None or outcome.cause is None else f"{part};degraded={outcome.cause}")
        return ",".join(parts)

    def store_tokens(self, ran: Mapping[int, Outcome] | None = None) -> int:
        """How many of the prompt's tokens had their K/V read from the store rather than computed, over the images
        that ran as planned: an exact hit's every token, an approximate hit's reused ones (B: their late layers; the
        first W layers are computed for every token). With ``ran`` None, as planned. A degraded plan (some rows
        computed after a failed read) still counts its plan's rows."""
        if self.plan is None:
            return 0
        total = 0
        for index, image in enumerate(self.plan.images):
            outcome = outcome_of(ran, index)
            if outcome is not None and outcome.ran != PLANNED:
                continue  # computed as after a miss, or served by SGLang's prefix cache
            if image.kind == EXACT:
                total += image.tokens
            elif image.kind == APPROXIMATE:
                total += len(image.reuse)
        return total

    def fallbacks(self, ran: Mapping[int, Outcome]) -> list[tuple[str, Outcome]]:
        """(planned kind, outcome) of each image, and each video patch (its kind as ``patch_<kind>``, reported after
        the images: engine_ext.executor.rows), that did not run exactly as planned."""
        kinds = [*self.kinds, *(f"patch_{kind}" for video in self.patch_kinds for kind in video)]
        return [(kind, outcome) for index, kind in enumerate(kinds)
                if (outcome := outcome_of(ran, index)) is not None and (outcome.fell_back or outcome.cause)]


def outcome_of(ran: Mapping[int, Outcome] | None, index: int) -> Outcome | None:
    return None if ran is None else ran.get(index, ran.get(EVERY_IMAGE))


class Planner:
    def __init__(self, cache: CacheManager, settings: ReuseSettings, matcher: Matcher | None = None,
                 costs: WorkerCosts | None = None, moved: MovedImages | None = None, *,
                 reuse_patches: bool = False) -> None:
        self.cache = cache
        self.settings = settings
        self.reuse_patches = reuse_patches  # videos' temporal patches are planned (VideoSettings.reuse_patches)
        self.matcher = matcher if settings.match.enabled else None
        self.moved = moved  # lines up content moved by part of a token (gateway/matching/moved.py); None: never
        self.costs = costs
        self._holder: OrderedDict[str, str] = OrderedDict()  # image or video key -> worker URL that last served it
        self.counts: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # images planned as misses, by why (REFUSALS)
        self.frames = FrameBook()  # the frames of recent videos (gateway/videos.py)
        # ... and their temporal patches, matched as near-duplicates where the images' matcher is on
        self.patches = PatchBook(settings.match, scope=self.matcher.scope if self.matcher is not None else "")

    @property
    def enabled(self) -> bool:
        return self.settings.enabled and self.cache.store is not None

    async def plan(self, intake: IntakeResult, *, selector: str | None = None, mode: str = "all") -> Planned:
        """One plan per image, read from the store, the books and the match index on the cache thread (never on
        the loop). ``selector`` overrides the settings' default selector for approximate plans (the route checks
        that the settings allow it); ``mode`` (REUSE_MODES) limits what may be reused."""
        patches = self.reuse_patches and bool(intake.videos)
        if not self.enabled or not (intake.images or patches) or mode == "off":
            # A video not planned for runs as plain SGLang: it keeps to the worker that served it last.
            return Planned(None, self._video_holder(intake), ())
        # The worker likely to run it (the one that served one of its images last): its costs say what pays.
        costs = self._costs_for(next((self._holder[image.key] for image in intake.images
                                      if image.key in self._holder), None) or self._video_holder(intake))
        selector = selector or self.settings.match.selector
        try:
            plans, kinds, similarities, derived, refusals = await self.cache.run(
                self._plan_images, intake, selector, mode == "all", costs)
            patch_plans, patch_kinds = await self.cache.run(self._plan_patches, intake, selector, mode == "all",
                                                            costs) if patches else ([], ())
        except (StoreError, BooksError) as exc:
            # The shared tier or the shared books did not answer: the request runs as in plain SGLang (nothing
            # reused, nothing stored) rather than not at all.
            self.counts["store_unavailable"] += 1
            log.warning("planned nothing for a request: %s", exc)
            return Planned(None, self._video_holder(intake), ())
        prefer = next((self._holder[image.key] for image, kind in zip(intake.images, kinds, strict=True)
                       if kind != "miss" and image.key in self._holder), None) or self._video_holder(intake)
        return Planned(RequestPlan(images=tuple(plans), patches=tuple(patch_plans)), prefer, tuple(kinds),
                       tuple(similarities), tuple(derived), tuple(refusals), patch_kinds)

    def _video_holder(self, intake: IntakeResult) -> str | None:
        return next((self._holder[video.key] for video in intake.videos if video.key in self._holder), None)

    async def frames_seen(self, intake: IntakeResult) -> tuple[FramesSeen, ...]:
        """Per video: how many of its sampled frames were seen before, as stored images (looked up in the books on
        the cache thread) or in earlier videos; then its frames are remembered. Event loop."""
        if not intake.videos:
            return ()
        keys = [key for video in intake.videos for key in video.frame_keys]
        stored = await self.cache.run(self._in_books, keys) if self.enabled else frozenset()
        return tuple(self.frames.record(video, stored) for video in intake.videos)

    async def patches_seen(self, intake: IntakeResult, planned: Planned | None = None) -> tuple[PatchesSeen, ...]:
        """Per video: how many of its temporal patches an earlier video of the namespace had, the same or nearly:
        as ``planned`` planned them where it planned patches; else looked up in the patch book (a lookup per patch
        with features, on a thread: not the cache thread, which plans every request's images; keys alone are
        looked up here), which then remembers them."""
        if not intake.videos:
            return ()
        if planned is not None and planned.patch_kinds:
            matched = any(patch.features is not None for video in intake.videos for patch in video.patches)
            return tuple(PatchesSeen(patches=len(kinds), exact=kinds.count(EXACT),
                                     approximate=kinds.count(APPROXIMATE) if matched else None)
                         for kinds in planned.patch_kinds)

        def record() -> tuple[PatchesSeen, ...]:
            return tuple(self.patches.record(video, intake.namespace) for video in intake.videos)

        matched = any(patch.features is not None for video in intake.videos for patch in video.patches)
        return await asyncio.to_thread(record) if matched else record()

    def _in_books(self, keys: list[str]) -> frozenset[str]:
        return frozenset(key for key in keys if key in self.cache.policy)

    def _costs_for(self, url: str | None) -> CostModel | None:
        """The costs of the worker at ``url``, else of any measured worker; None when none is known (or plans are
        not chosen by cost)."""
        if self.costs is None:
            return None
        return (self.costs.model(url) if url is not None else None) or self.costs.any_model()

    def _plan_images(self, intake: IntakeResult, selector: str, approximate: bool = True,
                     costs: CostModel | None = None) -> \
            tuple[list[ImagePlan], list[str], list[float | None], list[bool], list[Refusal | None]]:
        """The cache thread's part of plan()."""
        plans: list[ImagePlan] = []
        kinds: list[str] = []
        similarities: list[float | None] = []
        derived: list[bool] = []
        refusals: list[Refusal | None] = []
        context = text_tokens(intake.text_chars) + sum(image.grid.tokens for image in intake.images)
        for image, prefix_digest in zip(intake.images, intake.prefix_digests, strict=True):
            grid = (image.grid.rows, image.grid.cols)
            stored = self._stored(image.key)
            similarities.append(None)
            derived.append(False)
            refusals.append(None)
            if stored is None:
                plan, refusals[-1] = self._plan_new(image, prefix_digest, intake.namespace, selector, approximate,
                                                    costs, context)
                plans.append(plan)
                kinds.append(plan.kind)
                if plan.kind != MISS:
                    similarities[-1] = plan.similarity
                continue
            same = stored.prefix_digest == prefix_digest
            ratios = () if same else self.settings.ratios
            if ratios is None:
                # Moving the image needs per-layer ratios, which need the model's layer count: recompute it all.
                plans.append(ImagePlan(key=image.key, kind=MISS, tokens=grid[0] * grid[1], grid=grid,
                                       store=False))
                kinds.append("miss")
                continue
            exact = ImagePlan(key=image.key, kind=EXACT, tokens=grid[0] * grid[1], grid=grid, ratios=ratios,
                              prefix_digest=prefix_digest)
            if not self._pays(exact, costs, context):
                plans.append(ImagePlan(key=image.key, kind=MISS, tokens=exact.tokens, grid=grid, store=False))
                kinds.append("miss")
                refusals[-1] = Refusal("cost", 1.0)
                continue
            plans.append(exact)
            kinds.append("exact_same_prefix" if same else "exact_moved")
            derived[-1] = stored.derived
            self.counts["derived_hit"] += stored.derived
            self.cache.record_exact_hit(image.key)
        self.counts.update(kinds)
        self.refused.update(refusal.reason for refusal in refusals if refusal is not None)
        return plans, kinds, similarities, derived, refusals

    def _plan_patches(self, intake: IntakeResult, selector: str, approximate: bool = True,
                      costs: CostModel | None = None) -> tuple[list[ImagePlan], tuple[tuple[str, ...], ...]]:
        """The cache thread's part of plan() for the videos' temporal patches (the module docstring): the plans,
        and per video each patch's kind (gateway.videos.PATCHES_SEEN)."""
        context = text_tokens(intake.text_chars) + sum(image.grid.tokens for image in intake.images) + \
            sum(video.grid[0] * video.grid[1] * len(video.patches) for video in intake.videos)
        plans: list[ImagePlan] = []
        kinds: list[tuple[str, ...]] = []
        for video in intake.videos:
            video_kinds = []
            for patch in video.patches:
                plan = self._patch_plan(patch, video.grid, intake.namespace, selector, approximate, costs, context)
                plans.append(plan)
                video_kinds.append(plan.kind)
                if plan.kind == EXACT:
                    self.cache.record_exact_hit(patch.key)
            kinds.append(tuple(video_kinds))
        self.counts.update(f"patch_{kind}" for video_kinds in kinds for kind in video_kinds)
        return plans, tuple(kinds)

    def _patch_plan(self, patch: TemporalPatch, grid: tuple[int, int], namespace: str, selector: str,
                    approximate: bool, costs: CostModel | None, context: int) -> ImagePlan:
        tokens = grid[0] * grid[1]
        stored = self._stored(patch.key)
        if stored is not None:
            ratios = self.settings.ratios
            if ratios is not None:  # moving a patch needs per-layer ratios (the model's layer count)
                exact = ImagePlan(key=patch.key, kind=EXACT, tokens=tokens, grid=grid, ratios=ratios)
                if self._pays(exact, costs, context, tower_runs=True):
                    return exact
                self.counts["patch_refused_cost"] += 1
            return ImagePlan(key=patch.key, kind=MISS, tokens=tokens, grid=grid, store=False)
        miss = ImagePlan(key=patch.key, kind=MISS, tokens=tokens, grid=grid)
        if self.matcher is None or patch.features is None:
            return miss
        lookup = self.matcher.lookup(namespace, patch.key, patch.features) if approximate else None
        alias = self._usable_alias(lookup.matches) if lookup is not None else None
        plan = None if alias is None else approximate_plan(
            alias, patch.features.entropy, key=patch.key, grid=grid, prefix_digest="", settings=self.settings.match,
            selector=selector, layers=self.settings.layers)
        if plan is not None:
            plan = replace(plan, vision=FULL_PASS, derive=False)
            if self._pays(plan, costs, context, tower_runs=True):
                assert alias is not None
                self.cache.record_approximate_hit(alias.alias)
                return plan
            self.counts["patch_refused_cost"] += 1
        self.matcher.add(patch.key, namespace, patch.features, lookup.query if lookup is not None else None)
        return miss

    def _plan_new(self, image: CanonicalImage, prefix_digest: str, namespace: str, selector: str,
                  approximate: bool = True, costs: CostModel | None = None,
                  context: int = 0) -> tuple[ImagePlan, Refusal | None]:
        """An image the store does not hold: approximate when it nearly duplicates a stored image of its
        namespace (and the guard agrees, and ``approximate``, and it pays), else a miss, with why where something
        stored was near. Either way the worker stores it, so it is indexed."""
        grid = (image.grid.rows, image.grid.cols)
        miss = ImagePlan(key=image.key, kind=MISS, tokens=grid[0] * grid[1], grid=grid,
                         prefix_digest=prefix_digest)
        if self.matcher is None or image.features is None:
            return miss, None
        if not approximate:
            self.matcher.add(image.key, namespace, image.features)
            return miss, None
        moved = self.moved.of(lambda: image.payload, grid) if self.moved is not None else None
        lookup = self.matcher.lookup(namespace, image.key, image.features, moved)
        alias = self._usable_alias(lookup.matches)
        plan = None if alias is None else approximate_plan(
            alias, image.features.entropy, key=image.key, grid=grid, prefix_digest=prefix_digest,
            settings=self.settings.match, selector=selector, layers=self.settings.layers)
        refusal = None
        if alias is None and lookup.best_similarity is not None:
            refusal = Refusal("alias_gone" if lookup.matches else "similarity", lookup.best_similarity)
        elif alias is not None and plan is None:
            refusal = Refusal("changed_share", alias.alignment.similarity)
        elif plan is not None and not self._pays(plan, costs, context):
            narrower = without_notes(plan, self.settings.match)
            reason = "notes" if narrower is not None and self._pays(narrower, costs, context) else "cost"
            refusal, plan = Refusal(reason, alias.alignment.similarity if alias is not None else 0.0), None
        if plan is None:
            self.matcher.add(image.key, namespace, image.features, lookup.query)
            return miss, refusal
        if not plan.derive:  # stored only if its worker runs it as a full prefill: indexed, pending until then
            self.matcher.add(image.key, namespace, image.features, lookup.query)
        assert alias is not None
        self.cache.record_approximate_hit(alias.alias)
        return plan, None

    def _pays(self, plan: ImagePlan, costs: CostModel | None, context: int, *, tower_runs: bool = False) -> bool:
        """Whether the plan is predicted to beat plain SGLang under ``costs`` (those of the worker likely to run
        it), in a prompt of ``context`` tokens; True without costs. ``tower_runs``: costs.image_work."""
        return costs is None or self.costs is None or \
            pays(plan, self.costs.facts, costs, context, tower_runs=tower_runs)

    def _usable_alias(self, matches: tuple[Match, ...]) -> Match | None:
        """The best match whose entry the store holds (admitting it to the books if need be). Matches whose entry
        is gone, and not merely still being written by a worker, leave the index."""
        assert self.matcher is not None
        for match in matches:
            stored = self._stored(match.alias)
            if stored is not None and not stored.derived:
                return match
            if stored is not None or not self.matcher.is_pending(match.alias):
                self.matcher.remove(match.alias)
        return None

    def served(self, intake: IntakeResult, worker_url: str) -> None:
        """The request went well on this worker: it now holds its images in its own caches. Event loop only."""
        for key in [image.key for image in intake.images] + [video.key for video in intake.videos]:
            _remember(self._holder, key, worker_url)

    def _stored(self, key: str) -> Stored | None:
        """What the entry stored under key records (its prefix digest, "" when unknown; whether it is derived), or
        None when no usable entry is stored; admits entries workers wrote since the last look. Cache thread only."""
        store = self.cache.store
        assert store is not None  # planning is enabled only with a store
        in_books = key in self.cache.policy
        header = store.get_sparse(key, [], (0, 1))  # reads and verifies the header only
        if header is None:
            if in_books:  # the store lost it (damaged, removed outside the gateway): the books follow
                self.cache.drop(key)
            return None
        with header:
            stored = Stored(header.header.prefix_digest, header.header.derived)
        if in_books:
            return stored
        if not self.cache.take_in([key]).restored:  # no room for it anywhere (then removed), or gone since
            return None
        self.counts["admitted"] += 1
        return stored


@dataclass(frozen=True)
class Stored:
    """What the planner reads of a stored entry's header."""

    prefix_digest: str  # the prompt's digest before the image when the entry was made; "" when unknown
    derived: bool  # its K/V were computed by an approximate plan (never an alias)


def _remember(mapping: OrderedDict, key: str, value) -> None:
    mapping[key] = value
    mapping.move_to_end(key)
    while len(mapping) > _REMEMBERED:
        mapping.popitem(last=False)
