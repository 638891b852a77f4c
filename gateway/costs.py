"""Predicted time to first token: what each plan would cost on a worker, so that the planner can choose the plan
that pays, or none.

A worker's time to its first token is, to first order, the work it does before that token times what each unit
of that work costs on that worker (its model, device and parallel layout). The units (``FEATURES``):

    request               once per request: scheduling, tokenising, the first decode step, HTTP both ways
    token_layers          prompt tokens x decoder layers computed on SGLang's own path (plain SGLang, a miss)
    planned_token_layers  prompt tokens x decoder layers computed in the engine extension's own layer loop (the
                          recomputed rows of an exact moved hit, an approximate hit's warmup and recomputed rows)
    attention_pairs       the two above times the context each row attends over, in millions: prefill's attention
                          grows with the prompt (rows are taken to attend over half the prompt, on average)
    vision_patches        patches through the vision tower (four per image token on Qwen-VL)
    vision_pairs          patches squared, per image, in millions: SGLang's CPU vision attention materialises an
                          s x s mask and attends over it in every block (sglang/srt/layers/attention/vision.py,
                          VisionSdpaAttention._generate_mask_cache), so on a CPU worker it is most of a large
                          image's vision time; a GPU's varlen kernels pay it only in the full-attention blocks
    read_token_layers     stored image tokens x layers read from the store (K and V of every KV head)
    planned_images        once per image run under a plan: the plan's checks, the entry's header probe
    padded_pairs          the attention pairs of prompt rows SGLang's prefix cache held, in millions, which an
                          attention backend that pads an extend to the whole sequence computes again (SGLang's CPU
                          backend, torch_native: gateway.workers.PADDED_EXTEND_BACKENDS); its own unit, as that
                          backend's masked attention over the whole sequence costs per pair what prefill's does not

``Costs`` holds seconds per unit. ``CostModel`` fits them to measured samples (the time from sending a request to
its first event, taken only from requests the worker served alone, so queueing is not counted as work) by least
squares with no negative cost, pulled toward a prior (the calibration's figures) with the weight of one sample,
so that a unit the samples never exercise keeps its prior instead of falling to zero: a cost the model has not
seen must not make a plan look free; robustly (``robust_fit``), since some samples' work is not what the worker
did: SGLang's own caches serve repeats, which ``SglangCaches`` guesses from what the gateway sent each worker.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from plan import APPROXIMATE, CACHEBLEND, EXACT, PARTIAL_PASS, SAME, ImagePlan
from plan.budget import budget
from plan.checkpoint import model_config

FEATURES = ("request", "token_layers", "planned_token_layers", "attention_pairs", "vision_patches", "vision_pairs",
            "read_token_layers", "planned_images", "padded_pairs")


@dataclass(frozen=True, slots=True)
class Work:
    """What a worker computes or reads before a request's first token, in the units of ``FEATURES``."""

    request: float = 1.0
    token_layers: float = 0.0
    planned_token_layers: float = 0.0
    attention_pairs: float = 0.0
    vision_patches: float = 0.0
    vision_pairs: float = 0.0
    read_token_layers: float = 0.0
    planned_images: float = 0.0
    padded_pairs: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(self.vector(), other.vector(), strict=True)))

    def vector(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in FEATURES)

    @staticmethod
    def vision(patches: int) -> Work:
        """The vision tower over one image of ``patches`` patches (no request of its own)."""
        return Work(request=0.0, vision_patches=patches, vision_pairs=patches * patches / 1e6)

    def as_dict(self) -> dict[str, float]:
        return {name: round(value, 3) for name, value in zip(FEATURES, self.vector(), strict=True) if value}


assert tuple(f.name for f in fields(Work)) == FEATURES


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds per unit of each feature."""

    per_unit: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.per_unit) != len(FEATURES):
            raise ValueError(f"need one cost per feature {FEATURES}, got {len(self.per_unit)}")
        if any(not math.isfinite(c) or c < 0 for c in self.per_unit):
            raise ValueError(f"costs must be finite and not negative, got {self.per_unit}")

    @classmethod
    def of(cls, **per_unit: float) -> Costs:
        unknown = set(per_unit) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost features {sorted(unknown)}; known: {FEATURES}")
        return cls(tuple(float(per_unit.get(name, 0.0)) for name in FEATURES))

    def seconds(self, work: Work) -> float:
        return sum(c * w for c, w in zip(self.per_unit, work.vector(), strict=True))

    def as_dict(self) -> dict[str, float]:
        return {name: float(f"{cost:.4g}") for name, cost in zip(FEATURES, self.per_unit, strict=True)}


class CostModel:
    """One worker profile's costs: a prior, refitted to the last ``window`` samples as they come (every
    ``refit_every`` samples, or on a sample ``refit_after_s`` or more after the last fit), none below ``floor``.

    Thread-safe: samples arrive from the event loop, predictions are asked on the cache thread."""

    def __init__(self, prior: Costs, *, window: int = 256, prior_weight: float = 1.0, refit_every: int = 8,
                 refit_after_s: float = 1.0, floor: Costs | None = None) -> None:
        if floor is not None and any(f > p for f, p in zip(floor.per_unit, prior.per_unit, strict=True)):
            raise ValueError(f"a prior below its floor: {prior.as_dict()} under {floor.as_dict()}")
        self.prior = prior
        self.costs = prior
        self.floor = floor
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._prior_weight = prior_weight
        self._refit_every = refit_every
        self._refit_after_s = refit_after_s
        self._since_fit = 0
        self._fitted_at = 0.0
        self._lock = threading.Lock()
        self.observed = 0
        self.left_out = 0  # samples the last fit left out (robust_fit)

    def predict(self, work: Work) -> float:
        return self.costs.seconds(work)

    def observe(self, work: Work, seconds: float) -> None:
        """A measured time to first event for ``work``, served alone."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        with self._lock:
            self._samples.append((work.vector(), seconds))
            self.observed += 1
            self._since_fit += 1
            # Every ``refit_every`` samples, or on the first sample ``refit_after_s`` after the last fit: a worker
            # whose requests take seconds (samples are few) is refitted on each, one serving many only so often.
            if self._since_fit >= self._refit_every or time.monotonic() - self._fitted_at >= self._refit_after_s:
                self._refit()

    def refit(self) -> None:
        with self._lock:
            self._refit()

    def _refit(self) -> None:
        self._since_fit = 0
        self._fitted_at = time.monotonic()
        if self._samples:
            works, seconds = zip(*self._samples, strict=True)
            self.costs, self.left_out = robust_fit(np.asarray(works), np.asarray(seconds), current=self.costs,
                                                   prior=self.prior, prior_weight=self._prior_weight,
                                                   floor=self.floor)

    def errors(self) -> dict[str, float] | None:
        """How far the current costs' predictions are from the samples held: median and 90th percentile of
        |predicted - measured| / measured."""
        with self._lock:
            samples = list(self._samples)
        if not samples:
            return None
        relative = sorted(abs(self.costs.seconds(Work(*w)) - s) / s for w, s in samples)
        return {"median": round(relative[len(relative) // 2], 3),
                "p90": round(relative[min(len(relative) - 1, int(0.9 * len(relative)))], 3)}

    def snapshot(self) -> dict:
        return {"costs": self.costs.as_dict(), "prior": self.prior.as_dict(), "samples": len(self._samples),
                "left_out": self.left_out, "observed": self.observed, "relative_error": self.errors()}


OUTLIER_RATIO = 3.0  # a sample predicted more than 3x or less than a third of its time is left out of a refit
OUTLIERS_AT_MOST = 0.1  # ... while such samples are at most this share of them (more: the worker has changed)


def robust_fit(works: np.ndarray, seconds: np.ndarray, *, current: Costs, prior: Costs, prior_weight: float = 1.0,
               floor: Costs | None = None) -> tuple[Costs, int]:
    """``fit`` made symmetric and robust, for samples some of which the work does not describe (an image a cache
    the gateway did not see served: a sample many times faster than its work; a stall: one slower). Squared
    relative error punishes a prediction 12x too high 150 times as much as one 8x too low, so one unseen cache hit
    among forty samples once pulled a fit's vision costs to nearly nothing, and every 1K-token miss after it was
    predicted at 0.13 of its time. Here the samples the ``current`` costs (fitted before them) predict more than
    ``OUTLIER_RATIO`` off either way are left out, while they are few (many such: the worker itself has changed,
    and all count), and each sample's error is weighed as if relative to the geometric mean of its time and its
    prediction (errors of 12x and of 1/12 weigh the same), reweighted once from the first fit. Returns the costs
    and how many samples were left out."""
    ratio = np.clip((works @ np.asarray(current.per_unit)) / seconds, 1e-3, 1e3)
    outliers = (ratio > OUTLIER_RATIO) | (ratio < 1 / OUTLIER_RATIO)
    keep = ~outliers if outliers.sum() <= OUTLIERS_AT_MOST * len(seconds) else np.ones(len(seconds), dtype=bool)
    costs = current
    for _ in range(2):
        # (prediction - time)^2 / (prediction x time) = (prediction - time)^2 / time^2 x (time / prediction)
        ratio = np.clip((works @ np.asarray(costs.per_unit)) / seconds, 1e-3, 1e3)
        costs = fit(works[keep], seconds[keep], prior=prior, prior_weight=prior_weight, floor=floor,
                    weights=1.0 / ratio[keep])
    return costs, int((~keep).sum())


def fit(works: Iterable[Iterable[float]], seconds: Iterable[float], *, prior: Costs,
        prior_weight: float = 1.0, floor: Costs | None = None, weights: np.ndarray | None = None) -> Costs:
    """Costs that minimise the squared relative error of the predictions over the samples (each sample's squared
    error times its ``weights``, 1 by default), with no cost below ``floor`` (none negative), plus ``prior_weight``
    samples' worth of pull toward ``prior`` on each cost (relative to its own size; the prior also sets each cost's
    scale for the solve)."""
    a = np.asarray(list(works), dtype=np.float64)
    y = np.asarray(list(seconds), dtype=np.float64)
    if a.ndim != 2 or a.shape[1] != len(FEATURES) or len(y) != len(a):
        raise ValueError(f"need samples of {len(FEATURES)} features, got shape {a.shape} for {len(y)} times")
    # Relative error: each sample's row scaled by 1 / its time, so a 50 ms request counts as much as a 50 s one.
    a, y = a / y[:, None], np.ones_like(y)
    if weights is not None:
        root = np.sqrt(np.asarray(weights, dtype=np.float64))
        a, y = a * root[:, None], y * root
    p = np.asarray(prior.per_unit, dtype=np.float64)
    # Each column in units of its prior's contribution to a typical sample, so the pull and the solve are scaled.
    scale = np.where(p > 0, p, 1.0)
    a_scaled = a * scale
    weight = math.sqrt(prior_weight)
    pulled = np.vstack([a_scaled, weight * np.eye(len(FEATURES))])
    target = np.concatenate([y, weight * np.where(p > 0, 1.0, 0.0)])
    # Each cost as its floor plus a part that is not negative: the solve is for that part.
    floors = np.asarray(floor.per_unit if floor is not None else np.zeros(len(FEATURES)), dtype=np.float64)
    lowest = floors / scale
    solution = lowest + nnls(pulled, target - pulled @ lowest)
    return Costs(tuple(float(v) for v in np.maximum(solution * scale, floors)))  # no rounding under a floor


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """argmin ||a x - b|| with x >= 0 (Lawson and Hanson's active set method; small problems only)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    gradient = a.T @ (b - a @ x)
    tolerance = 1e-10 * max(1.0, float(np.abs(a).max(initial=0.0)))
    for _ in range(iterations):
        if passive.all() or gradient[~passive].max(initial=-np.inf) <= tolerance:
            break
        candidates = np.where(~passive, gradient, -np.inf)
        passive[int(np.argmax(candidates))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            steps = x[blocking] / (x[blocking] - z[blocking])
            alpha = float(steps.min()) if len(steps) else 0.0
            x = x + alpha * (z - x)
            passive &= x > tolerance
            x[~passive] = 0.0
        gradient = a.T @ (b - a @ x)
    return x



# --- the work of each plan ---

READ_BYTES_PER_S = 1e9  # a conservative store read (checksums verified, into the KV pool), until measured
TEXT_CHARS_PER_TOKEN = 4  # what a request's text is taken to cost when its tokens are not counted
TEMPLATE_TOKENS = 16  # the chat template's own tokens around a user message, about
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the work of a request depends on in the model, read from its folder by the gateway's settings: its
    decoder layers, the bytes of one token's K and V at one layer (every KV head, in the KV cache's dtype), the
    vision patches per image token (spatial_merge_size squared), the vision tower's attention window in image
    tokens (Qwen2.5-VL: 112 px windows of 28 px tokens; None for towers that attend globally, Qwen3-VL), and the
    bytes of one image token's vision output (what SGLang's encoder cache holds of it)."""

    layers: int
    kv_bytes_per_token_layer: int = 0
    patches_per_token: int = 4
    window_tokens: int | None = 4
    embedding_bytes_per_token: int = 0  # one image token's vision output (the decoder's width, in its dtype)

    @property
    def read_s_per_token_layer(self) -> float:
        return self.kv_bytes_per_token_layer / READ_BYTES_PER_S

    @classmethod
    def from_model_dir(cls, model_dir: Path | str) -> ModelFacts | None:
        """From the model folder's config.json (None when it does not say enough: no layer count, no heads)."""
        config = model_config(model_dir)
        if config is None:
            return None
        nested, vision_section = config.get("text_config"), config.get("vision_config")
        text: dict[str, Any] = nested if isinstance(nested, dict) else config
        vision: dict[str, Any] = vision_section if isinstance(vision_section, dict) else {}
        layers, heads, hidden = (text.get(name) for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
        if not (isinstance(layers, int) and isinstance(heads, int) and isinstance(hidden, int)) or \
                min(layers, heads, hidden) <= 0:
            return None
        kv_heads = text.get("num_key_value_heads") or heads
        head_dim = text.get("head_dim") or hidden // heads
        dtype = str(text.get("dtype") or config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        merge = int(vision.get("spatial_merge_size") or 2)
        window = vision.get("window_size")  # Qwen2.5-VL's windows, in pixels; none: the tower attends globally
        patch = int(vision.get("patch_size") or 14)
        window_tokens = int(window) // (patch * merge) if isinstance(window, int) and window > 0 else None
        kv_bytes = 2 * int(kv_heads) * int(head_dim) * _DTYPE_BYTES.get(dtype, 2)
        return cls(layers=layers, kv_bytes_per_token_layer=kv_bytes, patches_per_token=merge * merge,
                   window_tokens=window_tokens, embedding_bytes_per_token=hidden * _DTYPE_BYTES.get(dtype, 2))

def text_tokens(chars: int) -> int:
    """About how many tokens a chat request's text of ``chars`` characters is, with the template's own."""
    return TEMPLATE_TOKENS + -(-chars // TEXT_CHARS_PER_TOKEN)


def text_work(tokens: int, model: ModelFacts, context: int | None = None) -> Work:
    """A request's own cost and its text's prefill (the same under every plan of its images), in a prompt of
    ``context`` tokens (its own, if not given)."""
    token_layers = tokens * model.layers
    return Work(token_layers=token_layers, attention_pairs=_pairs(token_layers, tokens if context is None else context))


def _pairs(token_layers: float, context: int) -> float:
    return token_layers * context / 2 / 1e6


def image_work(plan: ImagePlan | None, model: ModelFacts, tokens: int, context: int = 0, *,
               tower_runs: bool = False) -> Work:
    """What one image of ``tokens`` tokens costs before the first token under ``plan`` (None, or a miss: computed
    as plain SGLang computes it, the vision tower and every layer), in a prompt of ``context`` tokens (at least
    the image's own). Selections are counted as engine_ext.selection makes them, from the plan alone (its budget,
    its candidates). ``tower_runs``: the vision tower encodes the image whatever the plan (a video's temporal
    patch: SGLang encodes the whole video)."""
    if tower_runs and plan is not None and plan.kind == EXACT:
        return image_work(plan, model, tokens, context) + Work.vision(tokens * model.patches_per_token)
    layers = model.layers
    context = max(context, tokens)
    if plan is None or plan.kind not in (EXACT, APPROXIMATE):
        computed = tokens * layers
        return Work(request=0.0, token_layers=computed, attention_pairs=_pairs(computed, context)) + \
            Work.vision(tokens * model.patches_per_token)
    if plan.kind == EXACT:
        recomputed = sum(math.floor(ratio * tokens) for ratio in plan.ratios)
        return Work(request=0.0, planned_token_layers=recomputed, attention_pairs=_pairs(recomputed, context),
                    read_token_layers=tokens * layers, planned_images=1)
    warmup = min(plan.warmup_layers, layers)
    recompute = budget(plan)  # as the worker's selection counts it, the question with the image
    first_read = 0 if plan.selector == CACHEBLEND else warmup  # CacheBlend scores K/V deviation from layer 0
    computed = tokens * warmup + recompute * (layers - warmup)
    work = Work(request=0.0, planned_token_layers=computed, attention_pairs=_pairs(computed, context),
                read_token_layers=len(plan.reuse) * (layers - first_read), planned_images=1)
    encoded = partial_pass_tokens(plan, model) if plan.vision == PARTIAL_PASS else tokens
    return work + Work.vision(encoded * model.patches_per_token)


def request_work(model: ModelFacts, text_chars: int, images: Sequence[tuple[int, ImagePlan | None]],
                 cached: Sequence[int] = (), embedded: Sequence[int] = (), padded: bool = False) -> Work:
    """A chat request's work: its text (``text_chars``) and each image (its tokens, and the plan it ran under: None
    for plain SGLang or a fallback to a full prefill); ``cached``: the tokens of its images SGLang's prefix cache
    served (no vision pass, no prefill: they only lengthen the context the rest attends over, unless the worker's
    attention is ``padded``: then their rows' attention is computed again, gateway.workers.PADDED_EXTEND_BACKENDS);
    ``embedded``: those of its images SGLang's encoder cache served (prefilled, with no vision pass)."""
    text = text_tokens(text_chars)
    context = text + sum(tokens for tokens, _ in images) + sum(cached) + sum(embedded)
    work = text_work(text, model, context)
    for tokens, plan in images:
        work = work + image_work(plan, model, tokens, context)
    if padded:
        work = work + Work(request=0.0, padded_pairs=_pairs(sum(cached) * model.layers, context))
    for tokens in embedded:
        work = work + Work(request=0.0, token_layers=tokens * model.layers,
                           attention_pairs=_pairs(tokens * model.layers, context))
    return work


class Held:
    """Keys held in a cache of ``capacity`` (tokens, bytes) and at most ``entries`` keys, the least recently put
    forgotten first."""

    def __init__(self, capacity: int, entries: int = 65_536) -> None:
        self.capacity = capacity
        self.entries = entries
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._total = 0

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def put(self, key: str, size: int) -> None:
        self._total += size - self._sizes.pop(key, 0)
        self._sizes[key] = size
        while (self._total > self.capacity or len(self._sizes) > self.entries) and self._sizes:
            self._total -= self._sizes.popitem(last=False)[1]


class SglangCaches:
    """What a worker's own SGLang caches are taken to hold, from what the gateway sent it: its prefix cache (a radix
    tree of prompts, by KV tokens: the prompts through each image, ``prompt_through``) and its encoder cache (each
    image's vision output, by bytes: the images, under their namespace, ``image_in``), the least recently sent
    forgotten first, as SGLang evicts. An image after a prompt sent before is served from the first: no vision pass,
    no prefill of its tokens; an image sent before after another prompt, from the second: prefilled, not encoded. A
    guess (SGLang may evict sooner, for other requests' running tokens), which prices the samples the costs are
    fitted to: repeats SGLang served in 1-2 s, priced as 17-96 s misses, pulled every vision cost of a fit to zero."""

    def __init__(self, kv_tokens: int, encoder_bytes: int) -> None:
        self.prompts = Held(kv_tokens)
        self.images = Held(encoder_bytes)
        self._lock = threading.Lock()

    def held(self, prompts: Sequence[str], images: Sequence[str]) -> tuple[frozenset[int], frozenset[int]]:
        """The indexes of ``prompts`` the prefix cache is taken to hold, and of ``images`` the encoder cache."""
        with self._lock:
            return (frozenset(i for i, key in enumerate(prompts) if key in self.prompts),
                    frozenset(i for i, key in enumerate(images) if key in self.images))

    def sent(self, prompts: Sequence[tuple[str, int]], images: Sequence[tuple[str, int]]) -> None:
        """Prompts (key, tokens) and images (key, bytes of their vision output) the worker was sent and served."""
        with self._lock:
            for key, tokens in prompts:
                self.prompts.put(key, tokens)
            for key, size in images:
                self.images.put(key, size)


def prompt_through(scope: str, prefix_digest: str, image_key: str) -> str:
    """A digest of a prompt up to and including an image: what comes before it (gateway.intake.prefix_digests) and
    the image, under the namespace SGLang's cache keeps it in (its ``extra_key``)."""
    return hashlib.blake2b(f"{scope}\0{prefix_digest}\0{image_key}".encode(), digest_size=16).hexdigest()


def image_in(scope: str, image_key: str) -> str:
    """An image under the namespace the engine extension keys SGLang's encoder cache by (its items' hashes)."""
    return hashlib.blake2b(f"{scope}\0{image_key}".encode(), digest_size=16).hexdigest()


def partial_pass_tokens(plan: ImagePlan, model: ModelFacts) -> int:
    """About how many tokens the partial vision pass encodes: those whose pixels differ ("~" or "x") and a ring
    of one around them, widened to whole attention windows (engine_ext/vision.py margin_tokens)."""
    rows, cols = plan.grid
    differ = {divmod(i, cols) for i, mark in enumerate(plan.change_map) if mark != SAME}
    ring = {(r + dr, c + dc) for r, c in differ for dr in (-1, 0, 1) for dc in (-1, 0, 1)
            if 0 <= r + dr < rows and 0 <= c + dc < cols}
    window = model.window_tokens
    if not window:
        return len(ring)
    windows = {(r // window, c // window) for r, c in ring}
    return sum(min(window, rows - wr * window) * min(window, cols - wc * window) for wr, wc in windows)


def pays(plan: ImagePlan, model: ModelFacts, costs: CostModel, context: int = 0, *, tower_runs: bool = False) -> bool:
    """Whether ``plan`` is predicted to cost less than computing the image as plain SGLang does (a miss), in a
    prompt of ``context`` tokens (``tower_runs``: see image_work)."""
    tokens = plan.tokens
    return costs.predict(image_work(plan, model, tokens, context, tower_runs=tower_runs)) < \
        costs.predict(image_work(None, model, tokens, context))
