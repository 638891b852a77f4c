"""The cost model: least squares with no negative cost, pulled toward its prior where the samples say nothing."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from gateway.calibration import calibrated, calibration_floor
from gateway.costs import (
    FEATURES,
    CostModel,
    Costs,
    Held,
    ModelFacts,
    SglangCaches,
    Work,
    fit,
    image_in,
    image_work,
    nnls,
    partial_pass_tokens,
    prompt_through,
    request_work,
    text_work,
)
from plan import APPROXIMATE, ATTENTION_ONLY, CACHEBLEND, EXACT, FULL_PASS, MISS, PARTIAL_PASS, ImagePlan

TRUE = Costs.of(request=0.05, token_layers=2e-5, planned_token_layers=2.6e-5, vision_patches=1e-4,
                vision_pairs=0.8, read_token_layers=1e-6, planned_images=0.004)


def plain(tokens: int, layers: int = 28, image_tokens: int = 0) -> Work:
    return Work(token_layers=tokens * layers) + (Work.vision(4 * image_tokens) if image_tokens else Work(request=0))


def exact(text: int, image_tokens: int, layers: int = 28) -> Work:
    return Work(token_layers=text * layers, read_token_layers=image_tokens * layers, planned_images=1)


def approximate(image_tokens: int, changed: float, layers: int = 28, warmup: int = 3, share: float = 0.3) -> Work:
    computed = image_tokens * (warmup + (layers - warmup) * share)
    return Work(token_layers=20 * layers, planned_token_layers=computed,
                read_token_layers=image_tokens * (layers - warmup), planned_images=1) + \
        Work.vision(int(4 * image_tokens * changed))


def samples(rng: random.Random, n: int, noise: float = 0.03) -> list[tuple[Work, float]]:
    out = []
    for _ in range(n):
        tokens = rng.choice([64, 256, 1024, 2304])
        work = rng.choice([plain(20 + tokens, image_tokens=tokens), plain(rng.randint(10, 2000)),
                           exact(20, tokens), approximate(tokens, rng.uniform(0.02, 0.4))])
        out.append((work, TRUE.seconds(work) * (1 + rng.gauss(0, noise))))
    return out


def test_nnls_matches_least_squares_when_unconstrained_and_clips_otherwise() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((40, 4))
    x = np.array([1.0, 2.0, 0.5, 3.0])
    assert np.allclose(nnls(a, a @ x), x, atol=1e-8)
    y = a @ np.array([1.0, -2.0, 0.5, 3.0])
    solved = nnls(a, y)
    assert (solved >= 0).all() and solved[1] == 0.0
    # The optimum under the constraint: no feasible step improves on it.
    residual = np.linalg.norm(a @ solved - y)
    for _ in range(200):
        assert np.linalg.norm(a @ np.maximum(solved + rng.normal(0, 0.05, 4), 0) - y) >= residual - 1e-9


def test_fit_recovers_the_costs_that_made_the_samples() -> None:
    data = samples(random.Random(1), 300)
    prior = Costs.of(**{name: 3 * cost for name, cost in TRUE.as_dict().items()})  # a prior 3x off everywhere
    fitted = fit([w.vector() for w, _ in data], [s for _, s in data], prior=prior)
    held_out = samples(random.Random(2), 100, noise=0.0)
    errors = [abs(fitted.seconds(w) - s) / s for w, s in held_out]
    assert max(errors) < 0.08, max(errors)
    # The costs the samples pin down (vision's two terms trade off over four image sizes; a plan's few ms hide
    # among seconds): the predictions above are what the planner uses.
    for name in ("token_layers", "planned_token_layers", "read_token_layers"):
        assert fitted.as_dict()[name] == pytest.approx(TRUE.as_dict()[name], rel=0.15), name


def test_a_cost_the_samples_never_exercise_keeps_its_prior() -> None:
    rng = random.Random(3)
    only_plain = [(w, s) for w, s in samples(rng, 400) if not w.planned_images][:60]
    prior = Costs.of(**{**TRUE.as_dict(), "planned_token_layers": 5e-5, "read_token_layers": 3e-6})
    fitted = fit([w.vector() for w, _ in only_plain], [s for _, s in only_plain], prior=prior).as_dict()
    assert fitted["planned_token_layers"] == pytest.approx(5e-5, rel=1e-6)
    assert fitted["read_token_layers"] == pytest.approx(3e-6, rel=1e-6)
    assert fitted["token_layers"] == pytest.approx(2e-5, rel=0.1)


def test_the_model_refits_as_samples_come_and_reports_its_error() -> None:
    model = CostModel(Costs.of(**{name: 2 * cost for name, cost in TRUE.as_dict().items()}), refit_every=16,
                      refit_after_s=math.inf)
    work = approximate(1024, 0.05)
    before = abs(model.predict(work) - TRUE.seconds(work)) / TRUE.seconds(work)
    for w, s in samples(random.Random(4), 160):
        model.observe(w, s)
    after = abs(model.predict(work) - TRUE.seconds(work)) / TRUE.seconds(work)
    assert before > 0.9 and after < 0.1, (before, after)
    snapshot = model.snapshot()
    assert snapshot["samples"] == 160 and snapshot["relative_error"]["median"] < 0.05
    model.observe(work, float("nan"))
    model.observe(work, -1.0)
    assert model.observed == 160


def test_a_floor_holds_a_cost_up_and_the_rest_refit_around_it() -> None:
    # Samples that a free prefill explains best: quadratic in the prompt, less than nothing linear.
    works = [text_work(tokens, SHAPE) for tokens in (10, 100, 300, 700, 1200, 2000)]
    seconds = [0.03 + 0.05 * w.attention_pairs - 5e-6 * w.token_layers for w in works]
    prior = Costs.of(request=0.03, token_layers=1e-6)
    free = fit([w.vector() for w in works], seconds, prior=prior, prior_weight=0.05)
    floor = Costs.of(token_layers=2e-7)
    assert free.as_dict()["token_layers"] < 2e-7 / 5
    held = fit([w.vector() for w in works], seconds, prior=prior, prior_weight=0.05, floor=floor).as_dict()
    assert held["token_layers"] == pytest.approx(2e-7, rel=1e-6)
    unrounded = fit([w.vector() for w in works], seconds, prior=prior, prior_weight=0.05, floor=floor)
    assert unrounded.per_unit[FEATURES.index("token_layers")] >= 2e-7  # exactly, so that a model may rest on it
    # Attention gives up what the floor took: the predictions stay about as close as the free fit's.
    assert held["attention_pairs"] < free.as_dict()["attention_pairs"]

    def worst(costs: Costs) -> float:
        return max(abs(costs.seconds(w) - s) / s for w, s in zip(works, seconds, strict=True))

    assert worst(Costs.of(**held)) < worst(free) + 0.05
    # A refit keeps the floor; a prior under its floor is refused.
    model = CostModel(Costs.of(request=0.03, token_layers=1e-6, attention_pairs=0.05), refit_every=1, floor=floor)
    for w, s in zip(works, seconds, strict=True):
        model.observe(w, s)
    assert model.costs.as_dict()["token_layers"] >= 2e-7 * (1 - 1e-6)
    with pytest.raises(ValueError, match="below its floor"):
        CostModel(Costs.of(token_layers=1e-7), floor=floor)


def test_calibration_on_noisy_probes_never_makes_prefill_free() -> None:
    """Probe times a busy machine gave (the middle text probe fast, the longest slow): unfloored, the fit put all of
    prefill in attention."""
    facts = ModelFacts(layers=4, kv_bytes_per_token_layer=64)
    probes = [(text_work(tokens, facts), t) for tokens, t in ((10, 0.038), (290, 0.04), (1200, 0.2))]
    probes += [(text_work(20, facts, grid + 20) + image_work(None, facts, grid, grid + 20), t)
               for grid, t in ((64, 0.06), (256, 0.1), (576, 0.25))]
    line = (0.2 - 0.038) / ((1200 - 10) * 4)
    unfloored = fit([w.vector() for w, _ in probes], [t for _, t in probes], prior=Costs.of(token_layers=line),
                    prior_weight=0.05)
    assert unfloored.as_dict()["token_layers"] == 0.0
    costs = calibrated(probes, facts).as_dict()
    assert costs["token_layers"] >= line / 4 * (1 - 1e-3)
    assert costs["planned_token_layers"] >= costs["token_layers"] and costs["request"] > 0
    assert calibration_floor(probes).as_dict()["token_layers"] == pytest.approx(line / 4, rel=1e-3)


def test_calibration_never_makes_the_request_free() -> None:
    """A CI run's probes fitted ``request`` at 0.0 (all of it put in prefill): the floor holds the request at a
    quarter of the text probes' line's intercept, in the calibration's fit as in every refit."""
    facts = ModelFacts(layers=4, kv_bytes_per_token_layer=64)
    probes = [(text_work(tokens, facts), t) for tokens, t in ((10, 0.05), (290, 0.08), (1200, 0.2))]
    request, slope = (0.05 * 1200 - 0.2 * 10) / (1200 - 10), (0.2 - 0.05) / ((1200 - 10) * 4)
    floor = calibration_floor(probes).as_dict()
    assert floor["request"] == pytest.approx(request / 4, rel=1e-3)
    assert floor["token_layers"] == pytest.approx(slope / 4, rel=1e-3)
    # Times a prefill without a request's own cost explains exactly: unfloored, the request comes out free.
    works = [text_work(tokens, facts) for tokens in (10, 290, 1200)]
    times = [w.token_layers * slope for w in works]
    assert fit([w.vector() for w in works], times, prior=Costs.of(token_layers=slope),
               prior_weight=0.05).as_dict()["request"] == 0.0
    held = fit([w.vector() for w in works], times, prior=Costs.of(token_layers=slope), prior_weight=0.05,
               floor=calibration_floor(probes)).as_dict()
    assert held["request"] >= request / 4 * (1 - 1e-3)  # as_dict rounds to four digits
    assert calibrated(probes, facts).as_dict()["request"] >= request / 4 * (1 - 1e-3)


def test_costs_refuse_what_cannot_be_a_cost() -> None:
    with pytest.raises(ValueError, match="unknown"):
        Costs.of(gpu_seconds=1.0)
    with pytest.raises(ValueError, match="negative"):
        Costs.of(request=-1.0)
    with pytest.raises(ValueError, match="one cost per feature"):
        Costs((1.0,))
    assert len(Work().vector()) == len(FEATURES)


# --- the work of each plan, counted from the plan alone ---

KEY, ALIAS = "a" * 64, "b" * 64
SHAPE = ModelFacts(layers=28)


def test_a_miss_and_plain_sglang_compute_every_layer_and_the_whole_tower() -> None:
    for plan in (None, ImagePlan(key=KEY, kind=MISS, tokens=64, grid=(8, 8))):
        work = image_work(plan, SHAPE, 64)
        # Its rows attend over half the prompt on average: here the image alone, 64 tokens.
        assert work.as_dict() == {"token_layers": 64 * 28, "attention_pairs": 0.057, "vision_patches": 256,
                                  "vision_pairs": 0.066}
    in_a_prompt = image_work(None, SHAPE, 64, context=1000)
    assert in_a_prompt.attention_pairs == pytest.approx(64 * 28 * 500 / 1e6)
    text = text_work(100, SHAPE)
    assert (text.request, text.token_layers, text.attention_pairs) == (1.0, 2800, pytest.approx(2800 * 50 / 1e6))


def test_an_exact_hit_reads_every_layer_and_recomputes_its_ratios() -> None:
    same = image_work(ImagePlan(key=KEY, kind=EXACT, tokens=64, grid=(8, 8)), SHAPE, 64)
    assert same.as_dict() == {"read_token_layers": 64 * 28, "planned_images": 1}
    moved = image_work(ImagePlan(key=KEY, kind=EXACT, tokens=64, grid=(8, 8), ratios=(0.5,) + (0.05,) * 27),
                       SHAPE, 64)
    assert moved.planned_token_layers == 32 + 27 * 3 and moved.read_token_layers == 64 * 28


def test_an_approximate_hit_counts_warmup_budget_reads_and_the_partial_pass() -> None:
    change_map = "=" * 64
    change_map = change_map[:9] + "x" + change_map[10:]  # token (1, 1) changed
    reuse = tuple(i for i in range(64) if i != 9)
    plan = ImagePlan(key=KEY, kind=APPROXIMATE, tokens=64, grid=(8, 8), alias=ALIAS, change_map=change_map,
                     warmup_layers=3, reuse=reuse, recompute_share=0.25, selector=ATTENTION_ONLY,
                     vision=PARTIAL_PASS)
    work = image_work(plan, SHAPE, 64)
    assert work.planned_token_layers == 64 * 3 + 16 * 25  # ceil(0.25 x 64) = 16 rows after the warmup
    assert work.read_token_layers == 63 * 25
    # The ring around (1, 1) spans rows and columns 0-2: windows (0, 0) only, 4 x 4 tokens.
    assert partial_pass_tokens(plan, SHAPE) == 16 and work.vision_patches == 64
    assert partial_pass_tokens(plan, ModelFacts(layers=28, window_tokens=None)) == 9
    full = image_work(dataclasses.replace(plan, vision=FULL_PASS), SHAPE, 64)
    assert full.vision_patches == 256
    many_changed = dataclasses.replace(plan, change_map="x" * 20 + change_map[20:], reuse=tuple(range(20, 64)))
    # the gateway widens rho to the changed share: every changed token recomputed
    widened = dataclasses.replace(many_changed, recompute_share=20 / 64)
    assert image_work(widened, SHAPE, 64).planned_token_layers == 64 * 3 + 20 * 25
    # left below it (a tight budget: engine_ext.selection), the budget holds: 16 of the 20 changed tokens
    assert image_work(many_changed, SHAPE, 64).planned_token_layers == 64 * 3 + 16 * 25
    blend = dataclasses.replace(plan, selector=CACHEBLEND, reuse=tuple(range(64)))
    assert image_work(blend, SHAPE, 64).read_token_layers == 64 * 28  # CacheBlend reads from layer 0


def test_an_image_the_prefix_cache_served_costs_only_the_context_it_adds() -> None:
    model = ModelFacts(layers=28)
    computed = request_work(model, 40, [(1024, None)])
    served = request_work(model, 40, [], cached=[1024])
    assert served.vision_patches == 0 and served.token_layers == request_work(model, 40, []).token_layers
    # the text still attends over the image's tokens
    assert served.attention_pairs == pytest.approx(computed.attention_pairs * 26 / 1050, rel=1e-3)
    # SGLang's CPU backend attends over the whole prompt after a cached prefix: the image's rows' attention again
    padded = request_work(model, 40, [], cached=[1024], padded=True)
    assert padded.attention_pairs + padded.padded_pairs == pytest.approx(computed.attention_pairs, rel=1e-3)
    assert (padded.token_layers, padded.vision_patches) == (served.token_layers, 0)


def test_what_sglang_caches_hold_is_kept_until_they_would_be_full() -> None:
    scope, other = "scope-a", "scope-b"
    first, second = prompt_through(scope, "p0", "img1"), prompt_through(scope, "p0", "img2")
    assert prompt_through(other, "p0", "img1") != first  # another namespace: SGLang keeps it apart (extra_key)
    assert prompt_through(scope, "p1", "img1") != first  # another prompt before the image
    assert image_in(other, "img1") != image_in(scope, "img1")  # the encoder cache is keyed per namespace too
    caches = SglangCaches(kv_tokens=3000, encoder_bytes=2_000_000)
    picture, another = image_in(scope, "img1"), image_in(scope, "img2")
    assert caches.held([first, second], [picture, another]) == (frozenset(), frozenset())
    caches.sent([(first, 1024)], [(picture, 1_000_000)])
    assert caches.held([first, second], [picture, another]) == (frozenset({0}), frozenset({0}))
    # the same image after another prompt: its vision output is held, its prompt is not
    assert caches.held([prompt_through(scope, "p1", "img1")], [picture]) == (frozenset(), frozenset({0}))
    caches.sent([(second, 1024), (first, 1024)], [(another, 1_000_000), (picture, 1_000_000)])
    third = prompt_through(scope, "p0", "img3")
    caches.sent([(third, 1024)], [(image_in(scope, "img3"), 1_000_000)])  # over both: the least recent goes
    assert caches.held([first, second, third], [picture, another]) == (frozenset({0, 2}), frozenset({0}))
    assert (len(caches.prompts), len(caches.images)) == (2, 2)
    # sizes unknown (0 bytes a token): the number of keys bounds it
    unsized = Held(capacity=100, entries=3)
    for n in range(5):
        unsized.put(f"k{n}", 0)
    assert len(unsized) == 3 and "k4" in unsized and "k1" not in unsized


def test_an_image_the_encoder_cache_served_is_prefilled_not_encoded() -> None:
    model = ModelFacts(layers=28)
    computed = request_work(model, 40, [(1024, None)])
    embedded = request_work(model, 40, [], embedded=[1024])
    assert embedded.vision_patches == 0 and embedded.vision_pairs == 0
    assert (embedded.token_layers, embedded.attention_pairs) == (computed.token_layers, computed.attention_pairs)


def test_a_sample_the_work_does_not_describe_does_not_move_the_fit() -> None:
    """One repeat served from a cache the gateway did not see (12x faster than its work) after forty samples: a
    plain relative fit gives way to it, the model's refit leaves it out."""
    drawn = samples(random.Random(6), 40)
    big = next(w for w, _ in drawn if w.vision_pairs > 10)
    prior = Costs.of(**{name: 1.5 * cost for name, cost in TRUE.as_dict().items()})
    model = CostModel(prior, refit_every=1)
    for w, s in drawn:
        model.observe(w, s)
    model.observe(big, TRUE.seconds(big) / 12)
    assert model.left_out == 1 and model.snapshot()["left_out"] == 1
    works = [w for w, _ in drawn]
    assert all(abs(model.predict(w) / TRUE.seconds(w) - 1) < 0.15 for w in works)
    plain_fit = fit([w.vector() for w in [*works, big]], [s for _, s in drawn] + [TRUE.seconds(big) / 12],
                    prior=prior)
    assert min(plain_fit.seconds(w) / TRUE.seconds(w) for w in works) < 0.5  # what it saves the costs from


def test_a_worker_that_changes_is_followed() -> None:
    """Samples all 4x slower than the costs (the worker shares its device now, say) are left out only while they
    are few, then followed as the window turns over (a restarted worker is measured anew instead)."""
    model = CostModel(TRUE, refit_every=1)
    for w, s in samples(random.Random(7), 40):
        model.observe(w, s)
    probe = approximate(1024, 0.05)
    for w, s in samples(random.Random(8), 120):
        model.observe(w, 4 * s)
    assert model.left_out == 0
    # 40 old samples and 120 new in the window: past halfway to the new costs on a log scale (a plain fit: 0.34)
    assert model.predict(probe) / (4 * TRUE.seconds(probe)) > 0.44


def test_a_sample_long_after_the_last_fit_is_fitted_at_once() -> None:
    """Samples of a slow worker are few (seconds each): each refits the costs, not every eighth."""
    prior = Costs.of(**{name: 2 * cost for name, cost in TRUE.as_dict().items()})
    model = CostModel(prior, refit_every=8, refit_after_s=0.0)
    w, s = samples(random.Random(5), 1)[0]
    model.observe(w, s)
    assert model.costs != prior
    held = CostModel(prior, refit_every=8, refit_after_s=math.inf)
    held.observe(w, s)
    assert held.costs == prior
