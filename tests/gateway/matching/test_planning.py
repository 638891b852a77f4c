"""Approximate plans: the reuse set per selector and the guard (plans.py), and the planner choosing them over a
real store (shared-memory files + LMDB) and a real feature store, never across namespaces."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway.cache import CacheManager
from gateway.calibration import WorkerCosts
from gateway.config import GatewayConfig, MatchSettings, PolicySettings, ProcessorSettings, ReuseSettings
from gateway.costs import CostModel, Costs, ModelFacts, pays
from gateway.images import canonicalize
from gateway.intake import IntakeResult
from gateway.matching.align import CHANGED
from gateway.matching.matcher import Matcher
from gateway.matching.plans import approximate_plan, plan_against
from gateway.planner import Planner
from gateway.policy import CachePolicy
from gateway.workers import WorkerPool
from plan import (
    APPROXIMATE,
    ATTENTION_ONLY,
    CACHEBLEND,
    DOWNSTREAM,
    ENTROPY_AWARE,
    FULL_PASS,
    FULL_REUSE,
    PARTIAL_PASS,
    SELECTORS,
    VLCACHE,
    ImagePlan,
)
from plan.outcome import FULL_PREFILL, PLANNED, PREFIX_CACHED, Outcome
from store import Entry, FeatureStore, StoreConfig
from store.tiered import TieredStore, open_tier
from tests.conftest import free_port, remove_store_memory
from tests.gateway.matching.pairs import CELL, EXTRACTOR, aligned, edited, encode_png, features, jpeg

SETTINGS = MatchSettings()
PROCESSOR = ProcessorSettings()


def match_of(a, b, settings: MatchSettings = SETTINGS):
    m = Matcher(settings, scope="s", features=None)
    m.add("a" * 64, "ns", features(a))
    found = m.lookup("ns", "b" * 64, features(b))
    assert found.matches
    return found.matches[0], features(b)


def plan_for(a, b, selector: str = ENTROPY_AWARE, settings: MatchSettings = SETTINGS, layers: int | None = 8):
    match, fb = match_of(a, b, settings)
    return approximate_plan(match, fb.entropy, key="b" * 64, grid=fb.grid, prefix_digest="p", settings=settings,
                            selector=selector, layers=layers), match


def test_entropy_aware_reuses_the_lowest_entropy_unchanged_tokens() -> None:
    a = aligned("page.png", 10, 16)
    b = edited(a, (5 * CELL + 3, 4 * CELL + 3, 7 * CELL + 10, 4 * CELL + 24))
    plan, match = plan_for(a, b)
    assert plan is not None and plan.kind == APPROXIMATE and plan.alias == "a" * 64
    assert len(plan.reuse) == int(0.1 * 160) and plan.recompute_share == 0.3 and plan.warmup_layers == 3
    changed = set(np.flatnonzero(match.alignment.changes == CHANGED).tolist())
    assert changed and not changed & set(plan.reuse)
    entropy = np.maximum(features(b).entropy.astype(np.float32), features(a).entropy.astype(np.float32))
    unchanged = sorted(set(range(160)) - changed, key=lambda i: entropy[i])
    assert max(entropy[list(plan.reuse)]) <= entropy[unchanged[len(plan.reuse)]]  # the lowest-entropy ones
    assert plan.change_map.count("x") == len(changed)
    assert plan.similarity == math.floor(match.alignment.similarity * 1e4) / 1e4 < 1.0  # rounded down


def test_each_selector_names_its_reuse_set() -> None:
    a = aligned("page.png", 10, 16)
    b = edited(a, (5 * CELL + 3, 4 * CELL + 3, 7 * CELL + 10, 4 * CELL + 24))
    plans = {selector: plan_for(a, b, selector)[0] for selector in SELECTORS}
    assert all(p is not None and p.selector == s for s, p in plans.items())
    unchanged = {i for i, c in enumerate(plans[ENTROPY_AWARE].change_map) if c != "x"}
    assert set(plans[ATTENTION_ONLY].reuse) == unchanged != set(range(160))
    for blind in (CACHEBLEND, VLCACHE, FULL_REUSE):  # blind to the change map: every aligned token is a candidate
        assert set(plans[blind].reuse) == set(range(160))
    assert plans[CACHEBLEND].warmup_layers == 1
    assert plans[FULL_REUSE].recompute_share == 0.0 and plans[VLCACHE].recompute_share > 0.0


def test_planning_against_a_chosen_alias_gives_the_plan_a_lookup_gives() -> None:
    a = aligned("page.png", 10, 16)
    b = edited(a, (5 * CELL + 3, 4 * CELL + 3, 7 * CELL + 10, 4 * CELL + 24))
    for selector in (ENTROPY_AWARE, CACHEBLEND):
        looked_up, _ = plan_for(a, b, selector)
        chosen = plan_against(features(b), features(a), alias="a" * 64, key="b" * 64, settings=SETTINGS,
                              selector=selector, layers=8, prefix_digest="p")
        assert chosen == looked_up and chosen is not None and chosen.alias == "a" * 64


def test_the_guard_plans_a_miss_when_too_much_changed_and_widens_r_below_that() -> None:
    a = aligned("text.png", 10, 10)
    b = a.copy()
    b.paste(aligned("camera.png", 10, 10).crop((0, 0, 10 * CELL, 4 * CELL)), (0, 0))  # 40% of the tokens replaced
    lenient = MatchSettings(match_threshold=0.0, max_changed_share=0.6)
    plan, match = plan_for(a, b, settings=lenient)
    share = float((match.alignment.changes == CHANGED).mean())
    assert plan is not None and share > 0.3 and plan.recompute_share == pytest.approx(share, abs=1e-4)
    strict = MatchSettings(match_threshold=0.0, max_changed_share=0.3)
    assert plan_for(a, b, settings=strict)[0] is None


def test_the_warmup_fits_the_model() -> None:
    a = aligned("chelsea.png", 6, 6)
    plan, _ = plan_for(a, jpeg(a), layers=2)
    assert plan is not None and plan.warmup_layers == 1


# --- the planner over a real store ---------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path):
    name = f"plan-{uuid.uuid4().hex[:12]}"
    config = StoreConfig(name=name, dram_dir=Path("/dev/shm") / f"revisit-store-{name}", lmdb_dir=tmp_path / "lmdb",
                         lmdb_map_size=8 << 20, pin_host_memory=False, lmdb_sync=False)
    store = TieredStore([open_tier(tier, config) for tier in config.tiers])
    features_store = FeatureStore(config.features_path)
    matcher = Matcher(SETTINGS, scope="test", features=features_store)
    manager = CacheManager(CachePolicy(PolicySettings()), store, on_gone=matcher.remove)
    yield manager, matcher
    manager.close()
    features_store.close()
    remove_store_memory(config)


def intake(image, namespace: str) -> IntakeResult:
    canonical = canonicalize(encode_png(image), limits=GatewayConfig(model="m", workers=("http://w",)).images,
                             processor=PROCESSOR, model="m", namespace=namespace,
                             extractor=EXTRACTOR)
    return IntakeResult(upstream_body={}, params=None, images=(canonical,), namespace=namespace,  # type: ignore
                        prefix_digests=("p",))


def store_like_a_worker(manager: CacheManager, key: str, grid: tuple[int, int], derived_from: str = "") -> None:
    n = grid[0] * grid[1]
    k = np.zeros((2, 1, n, 4), np.float16)  # (layers, kv_heads, tokens, head_dim)
    positions = np.stack([np.zeros(n), np.arange(n) // grid[1], np.arange(n) % grid[1]], axis=1).astype(np.int32)
    manager.store.put(key, Entry.from_arrays(model_id="m", grid=grid, positions=positions,  # type: ignore[union-attr]
                                             encoder_output=np.zeros((n, 4), np.float16), k=k, v=k,
                                             prefix_digest="p", derived_from=derived_from,
                                             derivation="selector=attention_only" if derived_from else ""))


def plan(planner: Planner, image, namespace: str):
    return asyncio.run(planner.plan(intake(image, namespace)))


def test_the_planner_plans_a_near_duplicate_as_approximate_in_its_namespace_only(cache) -> None:
    manager, matcher = cache
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8), matcher)
    a = aligned("page.png", 10, 16)
    first = plan(planner, a, "tenant-a")
    assert first.kinds == ("miss",) and first.plan is not None
    near = edited(a, (5 * CELL + 3, 4 * CELL + 3, 7 * CELL + 10, 4 * CELL + 24))
    assert plan(planner, near, "tenant-a").kinds == ("miss",)  # the first entry is not stored yet
    store_like_a_worker(manager, first.plan.images[0].key, (10, 16))
    again = plan(planner, near, "tenant-a")
    assert again.kinds == ("approximate",) and again.plan is not None
    image_plan = again.plan.images[0]
    assert image_plan.alias == first.plan.images[0].key and image_plan.store
    assert again.reuse_header().startswith("approximate;similarity=0.9")
    assert manager.policy.get(image_plan.alias).approximate_hits == 1
    assert plan(planner, near, "tenant-b").kinds == ("miss",)  # another tenant: never its alias
    assert planner.counts["approximate"] == 1


def test_an_approximate_hit_leaves_a_derived_entry_its_next_sight_hits_exactly_and_never_an_alias(cache) -> None:
    manager, matcher = cache
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8), matcher)
    a = aligned("page.png", 10, 16)
    alias = plan(planner, a, "ns").plan.images[0].key  # type: ignore[union-attr]
    store_like_a_worker(manager, alias, (10, 16))
    near = edited(a, (5 * CELL + 3, 4 * CELL + 3, 7 * CELL + 10, 4 * CELL + 24))
    first = plan(planner, near, "ns")
    assert first.kinds == ("approximate",) and first.plan is not None
    image_plan = first.plan.images[0]
    assert image_plan.derive and image_plan.alias == alias
    assert image_plan.key not in matcher.index  # never an alias: not indexed
    store_like_a_worker(manager, image_plan.key, (10, 16), derived_from=alias)  # what its worker stores
    again = plan(planner, near, "ns")
    assert again.kinds == ("exact_same_prefix",) and again.derived == (True,)
    assert again.reuse_header() == "exact_same_prefix;derived" and planner.counts["derived_hit"] == 1
    # The store's tokens: an approximate hit's reused ones (B), an exact hit's every one, none once it fell back.
    assert first.store_tokens() == len(image_plan.reuse) and 0 < len(image_plan.reuse) < 160
    assert again.store_tokens() == 160 and again.store_tokens({0: Outcome(FULL_PREFILL, "entry_damaged")}) == 0
    assert again.store_tokens({0: Outcome(PLANNED, "kv_read_failed")}) == 160
    # SGLang's prefix cache held the image: nothing read, no fallback, and the header says so.
    cached = {0: Outcome(PREFIX_CACHED)}
    assert again.store_tokens(cached) == 0 and again.fallbacks(cached) == []
    assert again.reuse_header(cached) == "exact_same_prefix;derived;prefix_cached"
    assert plan(planner, a, "ns").reuse_header() == "exact_same_prefix"  # a miss's entry is not derived
    # A derived entry an index still holds (an older gateway's) is skipped as an alias, and leaves the index.
    matcher.add(image_plan.key, "ns", features(near))
    closer = edited(near, (1 * CELL + 3, 1 * CELL + 3, 2 * CELL + 10, 1 * CELL + 24))
    third = plan(planner, closer, "ns")
    assert third.kinds == ("approximate",) and third.plan.images[0].alias == alias  # type: ignore[union-attr]
    assert image_plan.key not in matcher.index


def test_without_derived_entries_an_approximate_image_is_indexed_and_stored_only_as_a_full_prefill(cache) -> None:
    manager, matcher = cache
    settings = ReuseSettings(store=StoreConfig(), layers=8, match=MatchSettings(derive=False))
    planner = Planner(manager, settings, Matcher(settings.match, scope="test", features=None))
    a = aligned("page.png", 10, 16)
    store_like_a_worker(manager, plan(planner, a, "ns").plan.images[0].key, (10, 16))  # type: ignore[union-attr]
    near = plan(planner, jpeg(a), "ns")
    assert near.kinds == ("approximate",) and near.plan is not None
    assert not near.plan.images[0].derive and near.plan.images[0].key in planner.matcher.index  # type: ignore


def test_an_evicted_alias_leaves_the_index(cache) -> None:
    manager, matcher = cache
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8), matcher)
    a = aligned("coffee.png", 8, 8)
    key = plan(planner, a, "ns").plan.images[0].key  # type: ignore[union-attr]
    store_like_a_worker(manager, key, (8, 8))
    assert plan(planner, jpeg(a), "ns").kinds == ("approximate",)
    manager.remove(key, force=True)
    assert key not in matcher.index and matcher.features.index_record(key) is None  # type: ignore[union-attr]
    assert plan(planner, jpeg(a, 60), "ns").plan.images[0].alias != key  # type: ignore[union-attr]


def test_a_match_whose_entry_never_arrived_is_dropped_after_the_grace(cache) -> None:
    manager, _ = cache
    matcher = Matcher(MatchSettings(pending_grace_s=0), scope="test", features=None)
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8), matcher)
    a = aligned("rocket.jpg", 8, 8)
    key = plan(planner, a, "ns").plan.images[0].key  # type: ignore[union-attr]
    gone = plan(planner, jpeg(a), "ns")
    assert gone.kinds == ("miss",) and key not in matcher.index
    assert gone.reuse_header().startswith("miss;nearest=0.9") and gone.reuse_header().endswith("refused=alias_gone")


def test_a_miss_says_why_nothing_near_it_was_reused_and_the_planner_counts_it(cache) -> None:
    """A miss near a stored image of its namespace says how near and why it was refused: the nearest fell short of
    the match threshold (similarity), or matched with more changed than the guard allows (changed_share). Nothing
    near, or only another namespace's: a plain miss."""
    manager, _ = cache
    # every same-grid entry compared finely; a 40% change matches (0.65), an unrelated image does not (< 0.5)
    settings = MatchSettings(coarse_threshold=0.0, match_threshold=0.6, max_changed_share=0.3)
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8, match=settings),
                      Matcher(settings, scope="test", features=None))
    a = aligned("text.png", 10, 10)
    store_like_a_worker(manager, plan(planner, a, "ns").plan.images[0].key, (10, 10))  # type: ignore[union-attr]
    unrelated = plan(planner, aligned("coffee.png", 10, 10), "ns")
    header = unrelated.reuse_header()
    assert unrelated.kinds == ("miss",) and header.startswith("miss;nearest=0.") and header.endswith(
        ";refused=similarity")
    assert float(header.split("nearest=")[1].split(";")[0]) < settings.match_threshold
    b = a.copy()
    b.paste(aligned("camera.png", 10, 10).crop((0, 0, 10 * CELL, 4 * CELL)), (0, 0))  # 40% of the tokens replaced
    changed = plan(planner, b, "ns")
    header = changed.reuse_header()
    assert changed.kinds == ("miss",) and header.endswith(";refused=changed_share")
    assert float(header.split("nearest=")[1].split(";")[0]) >= settings.match_threshold
    assert planner.refused == {"similarity": 1, "changed_share": 1}
    assert plan(planner, aligned("camera.png", 10, 10), "other").reuse_header() == "miss"  # nothing of its own


def test_a_downstream_plan_holds_the_changed_tokens_and_their_noted_ones_or_is_refused_for_notes(cache) -> None:
    """The downstream selector (the default) recomputes the changed tokens and the ones right after and right below
    each (which took notes of their old values): rho is widened to hold them. Where the plan would pay without them
    but not with them, the image is a miss that says refused=notes; where it would not pay either way, cost."""
    from engine_ext.selection import select
    from gateway.matching.plans import without_notes
    from plan.budget import noted_tokens

    manager, _ = cache
    client = httpx.AsyncClient()
    costs = WorkerCosts(ModelFacts(layers=8, kv_bytes_per_token_layer=64), "m", PROCESSOR,
                        WorkerPool([], client, interval_s=1.0, timeout_s=1.0), client)
    settings = MatchSettings(coarse_threshold=0.0, match_threshold=0.6, max_changed_share=0.3)
    assert settings.selector == DOWNSTREAM
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8, match=settings),
                      Matcher(settings, scope="test", features=None), costs)
    a = aligned("text.png", 10, 10)
    store_like_a_worker(manager, plan(planner, a, "ns").plan.images[0].key, (10, 10))  # type: ignore[union-attr]
    other = aligned("camera.png", 10, 10)

    def replaced(cells):
        b = a.copy()
        for row, col in cells:
            box = (col * CELL, row * CELL, (col + 1) * CELL, (row + 1) * CELL)
            b.paste(other.crop(box), box[:2])
        return b

    # one block of 2 x 2 tokens: 4 changed and 4 noted; rho 0.3 already holds them
    near = plan(planner, replaced([(4, 4), (4, 5), (5, 4), (5, 5)]), "ns")
    assert near.kinds == ("approximate",), near.reuse_header()
    image = near.plan.images[0]  # type: ignore[union-attr]
    changed = [i for i, mark in enumerate(image.change_map) if mark == "x"]
    noted = noted_tokens(image.change_map, image.grid)
    assert changed and noted and image.selector == DOWNSTREAM and without_notes(image, settings) is None
    assert set(changed) | set(noted) <= set(select(image).recompute.tolist())
    # a token in every other row and column of the top half: 25% changed, twice as many more took notes of them
    scattered = replaced([(r, c) for r in range(0, 10, 2) for c in range(0, 10, 2)])
    wide = plan(planner, scattered, "ns")  # no worker measured yet: every plan is sent
    image = wide.plan.images[0]  # type: ignore[union-attr]
    narrow = without_notes(image, settings)
    assert wide.kinds == ("approximate",) and narrow is not None
    assert set(noted_tokens(image.change_map, image.grid)) <= set(select(image).recompute.tolist())
    # costs under which the plan pays without the noted tokens and not with them: refused for the notes
    for planned_rate in (1.2e-3, 1.4e-3, 1.6e-3, 1.8e-3, 2.0e-3):
        model = CostModel(Costs.of(token_layers=1e-3, vision_patches=1e-9, planned_token_layers=planned_rate,
                                   read_token_layers=1e-9))
        if pays(narrow, costs.facts, model, 0) and not pays(image, costs.facts, model, 0):
            break
    else:
        raise AssertionError("no planned-layer cost separates the plan with its notes from the one without")
    costs.models["http://worker"] = model
    refused = plan(planner, scattered, "ns")
    header = refused.reuse_header()
    assert refused.kinds == ("miss",) and header.endswith(";refused=notes"), header
    assert planner.refused["notes"] == 1
    # dear enough that neither pays: cost
    costs.models["http://worker"] = CostModel(Costs.of(token_layers=1e-7, vision_patches=1e-7,
                                                       planned_token_layers=1e-3))
    assert plan(planner, scattered, "ns").reuse_header().endswith(";refused=cost")


def test_matching_can_be_turned_off(cache) -> None:
    manager, matcher = cache
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), match=MatchSettings(enabled=False)), matcher)
    assert planner.matcher is None and plan(planner, aligned("camera.png", 4, 4), "ns").kinds == ("miss",)


def test_a_requested_selector_reaches_the_plan(cache) -> None:
    manager, matcher = cache
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8), matcher)
    a = aligned("astronaut.png", 8, 8)
    store_like_a_worker(manager, plan(planner, a, "ns").plan.images[0].key, (8, 8))  # type: ignore[union-attr]
    chosen = asyncio.run(planner.plan(intake(jpeg(a), "ns"), selector=VLCACHE))
    assert chosen.kinds == ("approximate",) and chosen.plan.images[0].selector == VLCACHE  # type: ignore[union-attr]
    default = asyncio.run(planner.plan(intake(jpeg(a, 60), "ns")))
    assert default.plan.images[0].selector == MatchSettings().selector == DOWNSTREAM  # type: ignore[union-attr]


def test_the_vision_pass_setting_reaches_approximate_plans() -> None:
    from gateway.config import ConfigError

    assert MatchSettings.from_env({}).vision_pass == PARTIAL_PASS
    full = MatchSettings.from_env({"REVISIT_MATCH_VISION_PASS": "full"})
    a = aligned("page.png", 10, 16)
    b = edited(a, (5 * CELL + 3, 4 * CELL + 3, 7 * CELL + 10, 4 * CELL + 24))
    assert plan_for(a, b, settings=dataclasses.replace(SETTINGS, vision_pass=full.vision_pass))[0].vision == FULL_PASS
    assert plan_for(a, b)[0].vision == PARTIAL_PASS
    with pytest.raises(ConfigError, match="vision_pass"):
        MatchSettings.from_env({"REVISIT_MATCH_VISION_PASS": "half"})


def test_with_the_cluster_or_the_books_away_requests_are_planned_nothing_at_once(tmp_path: Path, redis_server) -> None:
    """Either shared part gone: the request runs as plain SGLang (no plan), counted, and the next one does not wait
    for the cluster's client to give up again."""
    import os
    import signal
    import time

    from gateway.books import BookLog, SharedBooks
    from launcher.mooncake import MooncakeCluster

    cluster = MooncakeCluster.start(tmp_path / "mooncake", segment_bytes=64 << 20)
    name = f"away-{uuid.uuid4().hex[:8]}"
    config = StoreConfig(name=name, tiers=("mooncake",), mooncake_master=cluster.master_address,
                         mooncake_metadata_server=cluster.metadata_server, mooncake_admin_url=cluster.admin_url)
    books = SharedBooks(PolicySettings(), BookLog(redis_server, name=name), tiers=("mooncake",))
    books.load()
    manager = CacheManager(books, TieredStore([open_tier("mooncake", config)]))
    planner = Planner(manager, ReuseSettings(store=config, layers=8))
    try:
        image = aligned("chelsea.png", 4, 4)
        assert plan(planner, image, "t").kinds == ("miss",)
        os.killpg(cluster.master.pid, signal.SIGKILL)  # type: ignore[union-attr]
        planned = plan(planner, image, "t")
        assert planned.plan is None and planned.kinds == () and planner.counts["store_unavailable"] == 1
        started = time.monotonic()
        assert plan(planner, image, "t").plan is None and time.monotonic() - started < 1.0
        assert planner.counts["store_unavailable"] == 2
        # Now a store that answers, and books whose server is gone: an entry found in the store cannot be booked.
        manager.store.close()  # type: ignore[union-attr]
        manager.store = TieredStore([open_tier("dram", StoreConfig(name=name, dram_dir=tmp_path / "dram"))])
        books.log = BookLog(f"redis://127.0.0.1:{free_port()}/0", name=name, timeout_s=0.5)
        store_like_a_worker(manager, intake(image, "t").images[0].key, (4, 4))
        assert plan(planner, image, "t").plan is None and planner.counts["store_unavailable"] == 3
    finally:
        manager.close()
        cluster.stop()


def test_a_near_duplicate_predicted_not_to_pay_is_planned_as_a_storing_miss(cache) -> None:
    """With a worker's costs known, an approximate plan is sent only where it is predicted to beat plain SGLang;
    otherwise the image is a miss that stores it (so its next sight is exact), refused for its cost."""
    manager, matcher = cache
    client = httpx.AsyncClient()
    costs = WorkerCosts(ModelFacts(layers=8, kv_bytes_per_token_layer=64), "m", PROCESSOR,
                        WorkerPool([], client, interval_s=1.0, timeout_s=1.0), client)
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8), matcher, costs)
    a = aligned("page.png", 10, 16)
    first = plan(planner, a, "ns")
    store_like_a_worker(manager, first.plan.images[0].key, (10, 16))  # type: ignore[union-attr]
    near = edited(a, (5 * CELL + 3, 4 * CELL + 3, 7 * CELL + 10, 4 * CELL + 24))
    assert plan(planner, near, "ns").kinds == ("approximate",)  # no worker measured yet: every plan is sent
    # The executor's layer loop dear, SGLang's prefill and the tower cheap: reuse does not pay.
    costs.models["http://worker"] = CostModel(Costs.of(token_layers=1e-7, vision_patches=1e-7,
                                                       planned_token_layers=1e-3))
    refused = plan(planner, near, "ns")
    assert refused.kinds == ("miss",) and refused.plan is not None and refused.plan.images[0].store
    assert planner.refused["cost"] == 1
    assert refused.reuse_header().startswith("miss;nearest=0.9") and refused.reuse_header().endswith(";refused=cost")
    # The other way round: reuse pays.
    costs.models["http://worker"] = CostModel(Costs.of(token_layers=1e-3, vision_patches=1e-3,
                                                       planned_token_layers=1e-3, read_token_layers=1e-9))
    assert plan(planner, near, "ns").kinds == ("approximate",) and planner.refused["cost"] == 1


def test_the_planner_plans_a_page_scrolled_by_a_token_and_a_pixel_against_the_page_before(cache) -> None:
    """A scroll of 29 px (one token and one pixel) moves every token's content within it; the planner lines it up
    again from the bytes it forwards (gateway/matching/moved.py) and plans it with the whole-token shift and a full
    vision pass. Off (max_subtoken_px_y 0), it is a miss; so is a pan 7 px off the grid."""
    from gateway.matching.moved import MovedImages
    from tests.images_lib import load

    manager, matcher = cache
    page = load("page.png").convert("RGB")  # text at its own resolution: crisp, as a screenshot's
    a, b = page.crop((0, 0, 13 * CELL, 5 * CELL)), page.crop((0, 29, 13 * CELL, 29 + 5 * CELL))
    for max_px, kinds in ((0, ("miss",)), (13, ("approximate",))):
        settings = ReuseSettings(store=StoreConfig(), layers=8, match=MatchSettings(max_subtoken_px_y=max_px))
        planner = Planner(manager, settings, matcher,
                          moved=MovedImages(EXTRACTOR, CELL, settings.match))
        store_like_a_worker(manager, plan(planner, a, "ns").plan.images[0].key, (5, 13))  # type: ignore[union-attr]
        planned = plan(planner, b, "ns")
        assert planned.kinds == kinds
    image_plan = planned.plan.images[0]  # type: ignore[union-attr]
    assert image_plan.shift == (-1, 0) and image_plan.vision == FULL_PASS
    assert set(image_plan.change_map[-13:]) == {"x"}  # the row scrolled in
    panned = page.crop((7, 29, 7 + 13 * CELL, 29 + 5 * CELL))
    assert plan(planner, panned, "ns").kinds == ("miss",)


# --- a video's temporal patches ---

def video_intake(data: bytes, namespace: str) -> IntakeResult:
    from gateway.config import VideoSettings
    from gateway.videos import open_video

    video = open_video(data, settings=VideoSettings(), processor=PROCESSOR, model="m", namespace=namespace,
                       extractor=EXTRACTOR)
    return IntakeResult(upstream_body={}, params=None, images=(), namespace=namespace,  # type: ignore[arg-type]
                        videos=(video,))


def plan_video(planner: Planner, data: bytes, namespace: str = "ns"):
    return asyncio.run(planner.plan(video_intake(data, namespace)))


def test_a_videos_patches_are_planned_stored_then_exact_and_nearly_the_same(cache) -> None:
    from tests.videos_lib import encode_video, walker

    manager, matcher = cache
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8, ratios=(0.2,) * 8), matcher,
                      reuse_patches=True)
    frames = walker(frames=12)  # a still camera, someone walking past: 2 frames a second are every frame
    first = encode_video(frames[:6], fps=2, lossless=True)
    planned = plan_video(planner, first)
    assert planned.kinds == () and planned.patch_kinds == (("miss",) * 3,) and planned.plan is not None
    patches = planned.plan.patches
    assert all(p.kind == "miss" and p.store and p.grid == patches[0].grid for p in patches)
    assert asyncio.run(planner.patches_seen(video_intake(first, "ns"), planned))[0].header() == \
        "3;exact=0;approximate=0"
    for patch in patches:
        store_like_a_worker(manager, patch.key, patch.grid)
    # the next window (frames 2-7): its first two patches are the same two frames (lossless), moved in time
    later = plan_video(planner, encode_video(frames[2:8], fps=2, lossless=True))
    assert later.patch_kinds[0][:2] == ("exact", "exact") and later.plan is not None
    assert [p.key for p in later.plan.patches[:2]] == [p.key for p in patches[1:]]
    assert later.plan.patches[0].ratios == (0.2,) * 8
    # the first window again, re-encoded lossily: every pixel changed a little, every patch a near-duplicate
    again = plan_video(planner, encode_video(frames[:6], fps=2))
    assert again.patch_kinds == (("approximate",) * 3,) and again.plan is not None
    assert all(p.vision == FULL_PASS and not p.derive and p.alias in {q.key for q in patches}
               for p in again.plan.patches)
    # another namespace has seen nothing
    assert plan_video(planner, encode_video(frames[:6], fps=2), "other").patch_kinds == (("miss",) * 3,)


def test_without_patch_reuse_a_video_is_planned_nothing(cache) -> None:
    from tests.videos_lib import encode_video, walker

    manager, matcher = cache
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8), matcher)
    planned = plan_video(planner, encode_video(walker(frames=6), fps=2, lossless=True))
    assert planned.plan is None and planned.patch_kinds == ()


def test_a_patch_pays_only_with_what_its_layers_save(cache) -> None:
    """The vision tower encodes the whole video whatever a patch's plan: a patch's exact plan is sent only where
    reading its K/V beats computing its layers, however dear the tower (an image's plan would save the tower)."""
    from tests.videos_lib import encode_video, walker

    manager, matcher = cache
    client = httpx.AsyncClient()
    costs = WorkerCosts(ModelFacts(layers=8, kv_bytes_per_token_layer=64), "m", PROCESSOR,
                        WorkerPool([], client, interval_s=1.0, timeout_s=1.0), client)
    planner = Planner(manager, ReuseSettings(store=StoreConfig(), layers=8, ratios=(0.0,) * 8), matcher, costs,
                      reuse_patches=True)
    frames = walker(frames=8)
    first = plan_video(planner, encode_video(frames[:6], fps=2, lossless=True))
    for patch in first.plan.patches:  # type: ignore[union-attr]
        store_like_a_worker(manager, patch.key, patch.grid)
    later = encode_video(frames[2:8], fps=2, lossless=True)
    # The tower dear, the decoder cheap, reading dearer than computing: what a patch's plan could save is nothing.
    costs.models["http://worker"] = CostModel(Costs.of(token_layers=1e-7, vision_patches=1e-3,
                                                       read_token_layers=1e-6))
    refused = plan_video(planner, later)
    assert refused.patch_kinds[0][:2] == ("miss", "miss") and planner.counts["patch_refused_cost"] >= 2
    assert not any(p.store for p in refused.plan.patches[:2])  # type: ignore[union-attr]  # stored already
    image_exact = ImagePlan(key="c" * 64, kind="exact", tokens=16, grid=(4, 4), ratios=(0.0,) * 8)
    assert pays(image_exact, costs.facts, costs.models["http://worker"])  # an image's would pay: the tower saved
    # Reading cheap, the decoder dear: the same patches are exact.
    costs.models["http://worker"] = CostModel(Costs.of(token_layers=1e-3, vision_patches=1e-3,
                                                       read_token_layers=1e-9))
    assert plan_video(planner, later).patch_kinds[0][:2] == ("exact", "exact")
