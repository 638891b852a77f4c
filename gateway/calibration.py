"""Each worker's costs (gateway/costs.py): measured when it comes up, kept current from the requests it serves.

When a worker comes up (first seen healthy, or back after it was down: it may have been restarted on another
device or layout), the gateway measures it with a few requests of its own, sent while the worker has nothing else
in flight, each twice (the faster counts):

    text        prompts of one word, of about 300 and of about 1,200 tokens: the request's own cost, prefill per
                token and layer, and its attention's growth with the prompt
    image       plain requests with a noise image of 64, 256 and 576 tokens: the vision tower per patch (and per
                patch pair), the prefill known from the text probes
    repeat      on a worker whose attention backend pads an extend to the whole prompt (Worker.pads_extends),
                the largest image once more, which its prefix cache then holds: what attending over it again costs

Every probe is a plain request under a namespace of its own (``CALIBRATION_SCOPE``: SGLang's prefix cache keeps it
apart by ``extra_key``, and a request without a plan shares no encoder-cache entry with anyone, engine_ext keys its
items by its own id), with no plan, so it stores nothing and reads nothing; its ``max_tokens`` is 1, so its time is
its time to first token. Probe times are fitted by least squares over what they exercise; what the probes cannot
exercise starts from the fitted prefill: the engine extension's own layer loop at ``EXECUTOR_PREFILL_FACTOR`` times
SGLang's, a store read of a token's K/V at ``READ_BYTES_PER_S``, each planned image ``PLANNED_IMAGE_S``. From then
on, every request the worker serves alone (nothing else in flight there from its sending to its first event) is a
sample (``WorkerCosts.observe``), and the worker's costs are refitted to its recent samples.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Sequence

import httpx
import numpy as np
from PIL import Image

from gateway.config import ImageLimits, ProcessorSettings
from gateway.costs import (
    FEATURES,
    CostModel,
    Costs,
    ModelFacts,
    SglangCaches,
    Work,
    fit,
    image_work,
    request_work,
    text_work,
)
from gateway.images import data_url, encode_pixels, token_grid
from gateway.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

CALIBRATION_SCOPE = "revisit-calibration"
EXECUTOR_PREFILL_FACTOR = 1.2  # measured: an approximate hit's decoder part at 1.2x a decoder-only prefill (1K tokens)
PLANNED_IMAGE_S = 0.002
_TEXT_PROBES = (1, 40, 170)  # words (about seven tokens each)
_IMAGE_PROBES = (8, 16, 24)  # token grid sides: vision is quadratic on CPU, so three sizes
_IMAGE_QUESTION = "What is this?"  # the image probes' text
_PROBE_TIMEOUT_S = 600.0
PREDICTIONS_KEPT = 1024
RECENT_SHOWN = 64  # predictions shown one by one in /admin/stats
KV_TOKENS_ASSUMED = 65_536  # a worker's KV pool in tokens until its /server_info says (SGLang's CPU default here)
ENCODER_CACHE_BYTES = 100 * 2**20  # SGLang's encoder cache (SGLANG_VLM_CACHE_SIZE_MB, 100 by default in 0.5.23)


class WorkerCosts:
    """The cost models of the pool's workers, by URL. Samples and calibrations come from the event loop; predictions
    may be asked from any thread (CostModel locks)."""

    def __init__(self, facts: ModelFacts, model: str, processor: ProcessorSettings, pool: WorkerPool,
                 client: httpx.AsyncClient, images: ImageLimits | None = None) -> None:
        self.facts = facts
        self._model = model
        self._processor = processor
        self._images = images if images is not None else ImageLimits()  # how image probes are sent, as requests'
        self._pool = pool
        self._client = client
        self.models: dict[str, CostModel] = {}
        self.calibrations: dict[str, dict] = {}
        self._calibrating: dict[str, asyncio.Task] = {}
        self.predictions: deque[tuple[str, float, float, Work]] = deque(maxlen=PREDICTIONS_KEPT)
        self.caches: dict[str, SglangCaches] = {}  # what each worker's own caches are taken to hold

    def model(self, url: str) -> CostModel | None:
        return self.models.get(url)

    def any_model(self) -> CostModel | None:
        """A measured worker's costs (the first measured), for a plan whose worker is not known yet."""
        return next(iter(self.models.values()), None)

    def held(self, url: str, prompts: Sequence[str], images: Sequence[str]) -> tuple[frozenset[int], frozenset[int]]:
        """Which of ``prompts`` (costs.prompt_through) and ``images`` (costs.image_in), one of each per image of a
        request, worker ``url``'s prefix and encoder caches are taken to hold."""
        caches = self.caches.get(url)
        return caches.held(prompts, images) if caches is not None else (frozenset(), frozenset())

    def sent(self, url: str, prompts: Sequence[str], images: Sequence[str], tokens: Sequence[int]) -> None:
        """Worker ``url`` served a request of these ``prompts`` and ``images`` (one of each per image, ``tokens``
        each)."""
        if (caches := self.caches.get(url)) is None:
            caches = self.caches[url] = SglangCaches(KV_TOKENS_ASSUMED, ENCODER_CACHE_BYTES)
        per_token = self.facts.embedding_bytes_per_token
        caches.sent(list(zip(prompts, tokens, strict=True)), [(key, n * per_token) for key, n in zip(images, tokens,
                                                                                                    strict=True)])

    def observe(self, url: str, work: Work, seconds: float, *, kind: str = "") -> None:
        """A request ``url`` served alone: its work, its time to first token and its reuse label. What the costs
        predicted for it (before it is a sample) is kept beside what it measured, by label."""
        model = self.models.get(url)
        if model is None:
            return
        self.predictions.append((kind, model.predict(work), seconds, work))
        model.observe(work, seconds)

    def accuracy(self) -> dict[str, dict]:
        """By reuse label, over the last predictions: how many, and the median of predicted / measured and of
        |predicted - measured| / measured (the prediction made before the request was a sample)."""
        out = {}
        for kind in sorted({kind for kind, *_ in self.predictions}):
            pairs = [(p, m) for k, p, m, _ in self.predictions if k == kind]
            ratios = sorted(p / m for p, m in pairs)
            errors = sorted(abs(p - m) / m for p, m in pairs)
            out[kind] = {"requests": len(pairs), "predicted_over_measured": round(ratios[len(ratios) // 2], 3),
                         "relative_error": round(errors[len(errors) // 2], 3)}
        return out

    def came_up(self, worker: Worker) -> None:
        """Measure ``worker`` in the background (one measurement at a time per worker). It may have been restarted:
        its caches are taken to be empty."""
        self.caches[worker.url] = SglangCaches(KV_TOKENS_ASSUMED, ENCODER_CACHE_BYTES)
        running = self._calibrating.get(worker.url)
        if running is not None and not running.done():
            return
        self._calibrating[worker.url] = asyncio.get_running_loop().create_task(self._calibrate(worker),
                                                                                name=f"calibrate {worker.url}")

    async def aclose(self) -> None:
        for task in self._calibrating.values():
            task.cancel()
        await asyncio.gather(*self._calibrating.values(), return_exceptions=True)

    async def _calibrate(self, worker: Worker) -> None:
        url = worker.url
        started = time.monotonic()
        if worker.kv_tokens is not None and (caches := self.caches.get(url)) is not None:
            caches.prompts.capacity = worker.kv_tokens  # (the pool read /server_info as the worker came up)
        try:
            samples = await self._probe(worker, worker.pads_extends)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("worker %s: calibration failed (%s: %s); its costs stay unknown until it comes up again",
                        url, type(exc).__name__, exc)
            self.calibrations[url] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            return
        prior = self.prior(samples)
        self.models[url] = CostModel(prior, floor=calibration_floor(samples))
        self.calibrations[url] = {"seconds": round(time.monotonic() - started, 1), "probes": [
            {"work": work.as_dict(), "seconds": round(seconds, 4)} for work, seconds in samples]}
        log.info("worker %s calibrated in %.1f s: %s", url, time.monotonic() - started, prior.as_dict())

    def prior(self, samples: list[tuple[Work, float]]) -> Costs:
        """Costs from the probes: what they exercise fitted to them, the rest derived (the module's docstring)."""
        return calibrated(samples, self.facts)

    async def _probe(self, worker: Worker, padded: bool) -> list[tuple[Work, float]]:
        samples: list[tuple[Work, float]] = []
        rng = np.random.default_rng(secrets.randbits(32))
        for count in _TEXT_PROBES:
            best, prompt_tokens = None, 0
            for _ in range(2):
                words = " ".join(f"w{int(n)}" for n in rng.integers(0, 10**6, size=count))
                seconds, prompt_tokens = await self._timed(worker, [{"type": "text", "text": words}])
                best = seconds if best is None else min(best, seconds)
            assert best is not None
            samples.append((text_work(prompt_tokens, self.facts), best))
        for side in _IMAGE_PROBES:
            pixels = side * self._processor.factor
            grid = token_grid(pixels, pixels, self._processor)
            best, prompt_tokens = None, 0
            for _ in range(2):
                noise = Image.fromarray(rng.integers(0, 256, size=(pixels, pixels, 3), dtype=np.uint8))
                # Sent as the gateway sends a request's decoded image; encoded on a thread (as a PNG, a noise image
                # of 24 x 24 tokens takes tens of milliseconds, which the event loop's requests would wait out).
                url = await asyncio.to_thread(_probe_url, noise, self._images)
                content: list[dict] = [{"type": "image_url", "image_url": {"url": url}},
                           {"type": "text", "text": _IMAGE_QUESTION}]
                seconds, prompt_tokens = await self._timed(worker, content)
                best = seconds if best is None else min(best, seconds)
            assert best is not None
            samples.append((text_work(prompt_tokens - grid.tokens, self.facts, prompt_tokens) +
                            image_work(None, self.facts, grid.tokens, prompt_tokens), best))
        if padded:  # the largest image once more, which SGLang's prefix cache holds now: its rows' attention again
            seconds, _ = await self._timed(worker, content)
            samples.append((request_work(self.facts, len(_IMAGE_QUESTION), [], cached=[grid.tokens], padded=True),
                            seconds))
        return samples

    async def _timed(self, worker: Worker, content: list[dict]) -> tuple[float, int]:
        """One probe's seconds and prompt tokens, sent once the gateway has nothing else in flight there (and
        counted in flight there meanwhile, so that requests go elsewhere when they can)."""
        deadline = time.monotonic() + _PROBE_TIMEOUT_S
        while worker.inflight > 0:
            if time.monotonic() > deadline:
                raise ValueError("the worker was never idle for a probe")
            await asyncio.sleep(0.05)
        body = {"model": self._model, "messages": [{"role": "user", "content": content}], "max_tokens": 1,
                "temperature": 0, "rid": f"{CALIBRATION_SCOPE}-{secrets.token_hex(8)}",
                "extra_key": CALIBRATION_SCOPE}
        async with self._pool.lease(worker):
            started = time.perf_counter()
            response = await self._client.post(worker.url + "/v1/chat/completions", json=body,
                                               timeout=_PROBE_TIMEOUT_S)
            seconds = time.perf_counter() - started
        response.raise_for_status()
        return seconds, int(response.json()["usage"]["prompt_tokens"])

    def snapshot(self) -> dict:
        """Per worker URL: its costs, their prior, samples and fit error, and its calibration; and under
        ``"predicted"`` the predictions' accuracy by reuse label, under ``"recent"`` the last predictions one by one
        (label, predicted and measured seconds, the work priced)."""
        workers = {url: {**model.snapshot(), "calibration": self.calibrations.get(url)}
                   for url, model in self.models.items()}
        workers.update({url: {"calibration": calibration} for url, calibration in self.calibrations.items()
                        if url not in self.models})
        recent = [{"kind": kind, "predicted": round(p, 4), "measured": round(m, 4), "work": work.as_dict()}
                  for kind, p, m, work in list(self.predictions)[-RECENT_SHOWN:]]
        return {"workers": workers, "predicted": self.accuracy(), "recent": recent}


def _probe_url(image: Image.Image, limits: ImageLimits) -> str:
    return data_url(*encode_pixels(image, limits))


def _text_line(samples: list[tuple[Work, float]]) -> tuple[float, float]:
    """The request's own seconds and the seconds per token and layer of the straight line through the shortest and
    the longest text probe."""
    text = [(w, s) for w, s in samples if not w.vision_patches and not w.padded_pairs]
    (short, short_s), (long, long_s) = min(text, key=lambda x: x[0].token_layers), \
        max(text, key=lambda x: x[0].token_layers)
    per_token_layer = max((long_s - short_s) / max(long.token_layers - short.token_layers, 1.0), 1e-9)
    return max(short_s - short.token_layers * per_token_layer, 1e-4), per_token_layer


def calibration_floor(samples: list[tuple[Work, float]]) -> Costs:
    """The least a worker's request and prefill may cost, in its calibration and in every refit: a quarter of the
    text probes' line (its intercept, and its slope). Prefill's linear and quadratic parts, and a request's own cost,
    trade off over a few prompt lengths, and on a noisy machine fits made prefill free (all of it put in attention:
    a short prompt then predicted at the request's cost alone) and, in another CI run, the request free (all of it
    put in prefill); the executor's layer loop is never cheaper than SGLang's."""
    request, per_token_layer = _text_line(samples)
    return Costs.of(request=request / 4, token_layers=per_token_layer / 4,
                    planned_token_layers=EXECUTOR_PREFILL_FACTOR * per_token_layer / 4)


def calibrated(samples: list[tuple[Work, float]], facts: ModelFacts) -> Costs:
    """Costs from the probes. Prefill's linear and quadratic parts trade off over three prompt lengths (on the tiny
    model an unpulled fit put everything in attention), so the fit is pulled, with a twentieth of a probe's weight,
    toward the straight line through the shortest and the longest text probe (no quadratic part), and held at or
    above ``calibration_floor``. Vision is not pulled: on a CPU worker it is quadratic in the patches, and pulled toward
    a line through two small images the fit predicted a 1K-token miss on the deep bench model at 22 s (it takes
    38 s). What the probes cannot exercise is derived from prefill."""
    request, per_token_layer = _text_line(samples)
    line = Costs.of(request=request, token_layers=per_token_layer)
    fitted = fit([w.vector() for w, _ in samples], [s for _, s in samples], prior=line, prior_weight=0.05,
                 floor=calibration_floor(samples))
    costs = dict(zip(FEATURES, fitted.per_unit, strict=True))
    return Costs.of(request=costs["request"], token_layers=costs["token_layers"],
                    attention_pairs=costs["attention_pairs"], vision_patches=costs["vision_patches"],
                    vision_pairs=costs["vision_pairs"],
                    planned_token_layers=EXECUTOR_PREFILL_FACTOR * costs["token_layers"],
                    read_token_layers=facts.read_s_per_token_layer, planned_images=PLANNED_IMAGE_S,
                    padded_pairs=costs["padded_pairs"] or costs["attention_pairs"])
