"""Reuse plans on a tensor-parallel worker: a real SGLang CPU worker at ``--tp-size 2`` (two ranks, each holding
half the KV heads: the tiny Qwen2.5-VL and the oracle reader have two) beside a TP=1 worker, sharing one store.

An entry holds every KV head whatever layout wrote it: the TP=2 worker's miss gathers both ranks' heads and its
first rank stores the entry; each rank reads its own heads of an entry for a hit (engine_ext.executor.context).
What is checked: the TP=2 worker answers a miss and an exact hit as the TP=1 worker does, stores what a full
prefill computes, reuses the TP=1 worker's entries and the TP=1 worker reuses its; an approximate plan chooses the
reference's sets from both ranks' scores summed, and answers as the reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from offline.reference import Fresh, prefill
from plan import ENTROPY_AWARE, EXACT, MISS, PARTIAL_PASS, ImagePlan
from plan.outcome import PLANNED, Outcome
from tests.conftest import worker_events
from tests.engine_ext.reuse_lib import (
    APPROXIMATE_PREAMBLE,
    QUESTION,
    Pair,
    chat,
    content,
    edited,
    flush,
    gateway_plan,
    grid_of,
    key_for,
    ran,
    rid,
    stored_as_reference,
    text_of,
    top5,
    vision_runs,
    wait_stored,
    worker_pair,
)

pytestmark = pytest.mark.sglang

ARCH = "qwen2_5_vl"


@pytest.fixture(scope="module", params=["tiny", "oracle"])
def pair(request, tiny_models: dict[str, Path], model_cache: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """a: TP=1, b: TP=2, on the tiny model or the oracle reader."""
    from bundled import build_model

    path = tiny_models[ARCH] if request.param == "tiny" else build_model(ARCH, "oracle", cache_dir=model_cache)
    yield from worker_pair(ARCH, path, tmp_path_factory.mktemp(f"tensor-parallel-{request.param}"),
                           (("--tp-size", "1"), ("--tp-size", "2")), timeout=900)


@pytest.fixture(scope="module")
def picture(astronaut: Image.Image) -> Image.Image:
    return astronaut.resize((224, 224))


def miss_plan(key: str, grid: tuple[int, int]) -> ImagePlan:
    return ImagePlan(key=key, kind=MISS, tokens=grid[0] * grid[1], grid=grid)


@pytest.fixture(scope="module")
def plain(pair: Pair, picture: Image.Image) -> dict:
    """Each worker's answer without a plan (its radix cache flushed)."""
    parts = content("Look:", picture, QUESTION)
    answers = {}
    for name, worker in (("tp1", pair.a), ("tp2", pair.b)):
        flush(worker)
        answers[name] = chat(worker, parts)
    return answers


def test_the_two_ranks_answer_as_one(pair: Pair, plain: dict) -> None:
    assert "revisit model class active" in pair.b.log_file.read_text()
    assert text_of(plain["tp2"]) == text_of(plain["tp1"]) and text_of(plain["tp1"])
    assert top5(plain["tp2"]) == pytest.approx(top5(plain["tp1"]), abs=1e-4)


def test_a_tp2_miss_stores_every_head_as_a_full_prefill_computes_them(pair: Pair, picture: Image.Image,
                                                                      plain: dict) -> None:
    model = pair.model
    prompt = model.prompt(["Look:", picture, QUESTION])
    key, grid = key_for(f"{pair.model.num_layers}-tp2-astronaut"), grid_of(prompt)
    flush(pair.b)
    plan_rid = rid(miss_plan(key, grid))
    answer = chat(pair.b, content("Look:", picture, QUESTION), plan_rid=plan_rid)
    assert text_of(answer) == text_of(plain["tp2"])
    wait_stored(pair, key)
    assert ran(pair, plan_rid) == {0: Outcome(PLANNED)}  # reported once, by the first rank
    span = prompt.images[0]
    full = prefill(model, prompt, [Fresh(model.encode(prompt)[0])])
    entry = stored_as_reference(pair, key, prompt)
    assert entry.k.shape[2] == model.kv_heads  # both ranks' heads
    for layer in range(model.num_layers):
        assert (entry.k[layer] - full.state.k[layer][span.start : span.stop]).abs().max() < 1e-4
        assert (entry.v[layer] - full.state.v[layer][span.start : span.stop]).abs().max() < 1e-4
    assert pair.b.log_file.read_text().count(f"revisit: stored {key[:16]}") == 1


@pytest.mark.parametrize(("writer", "reader"), [("tp1", "tp2"), ("tp2", "tp1")])
def test_an_entry_written_at_one_layout_is_an_exact_hit_at_the_other(pair: Pair, picture: Image.Image,
                                                                     plain: dict, writer: str, reader: str) -> None:
    workers = {"tp1": pair.a, "tp2": pair.b}
    parts = content("Look:", picture, QUESTION)
    key = key_for(f"{pair.model.num_layers}-{writer}-written")
    grid = grid_of(pair.model.prompt(["Look:", picture, QUESTION]))
    flush(workers[writer])
    chat(workers[writer], parts, plan_rid=rid(miss_plan(key, grid)), tokens=1)
    wait_stored(pair, key)
    target = workers[reader]
    hits = f"revisit: exact hit {key[:16]}"
    hits_before, runs_before = target.log_file.read_text().count(hits), vision_runs(target)
    flush(target)
    plan_rid = rid(ImagePlan(key=key, kind=EXACT, tokens=grid[0] * grid[1], grid=grid))
    hit = chat(target, parts, plan_rid=plan_rid)
    assert target.log_file.read_text().count(hits) == hits_before + 1  # logged by the first rank alone
    assert vision_runs(target) == runs_before  # no rank ran its vision tower on the image
    assert ran(pair, plan_rid) == {0: Outcome(PLANNED)}
    assert text_of(hit) == text_of(plain[reader])
    assert top5(hit) == pytest.approx(top5(plain[reader]), abs=1e-4)


def test_an_approximate_hit_on_tp2_sums_both_ranks_scores_and_answers_as_the_reference(
    pair: Pair, picture: Image.Image
) -> None:
    from engine_ext.executor.approximate import tokens_digest
    from offline.reference import greedy
    from offline.reference.approximate import execute, partial_encoder

    model, image = pair.model, edited(picture)
    alias_prompt = model.prompt(["Look:", picture, QUESTION])
    grid = grid_of(alias_prompt)
    alias_key = key_for(f"{pair.model.num_layers}-tp-alias")
    chat(pair.a, content("Look:", picture, QUESTION), plan_rid=rid(miss_plan(alias_key, grid)), tokens=1)
    wait_stored(pair, alias_key)
    prompt = model.prompt([APPROXIMATE_PREAMBLE, image, QUESTION])
    plan = dataclasses.replace(gateway_plan(pair, alias_key, picture, image, grid, ENTROPY_AWARE),
                               key=key_for(f"{pair.model.num_layers}-tp2-edited"))
    alias = stored_as_reference(pair, alias_key, alias_prompt)
    encoder = partial_encoder(model, prompt, plan, alias)[0] if plan.vision == PARTIAL_PASS else model.encode(prompt)[0]
    approximate, chosen = execute(model, prompt, plan, encoder, alias)
    reference = prefill(model, prompt, [approximate])
    flush(pair.b)
    hits = f"revisit: approximate hit {plan.key[:16]}"
    before = pair.b.log_file.read_text().count(hits)
    events_before = worker_events([pair.b.url])
    plan_rid = rid(plan)
    served = chat(pair.b, content(APPROXIMATE_PREAMBLE, image, QUESTION), plan_rid=plan_rid, tokens=8)
    events = worker_events([pair.b.url]) - events_before
    # counted once for the worker (by its first rank), as the rows it chose
    assert events["approximate_executed"] == 1 and events["approximate_rows_dropped"] == len(chosen.drop)
    assert events["decode_steps_hiding"] >= 1 and events["decode_kept_off_graph"] >= 1
    lines = [x for x in pair.b.log_file.read_text().splitlines() if hits in x][before:]
    assert len(lines) == 1 and f"{chosen.summary()}, recomputed {tokens_digest(chosen.recompute)}" in lines[0]
    assert ran(pair, plan_rid) == {0: Outcome(PLANNED)}
    expected = sorted(reference.logits.log_softmax(-1).topk(5).values.tolist(), reverse=True)
    assert top5(served) == pytest.approx(expected, abs=2e-4)
    tokens = greedy(model, reference, 8)
    assert text_of(served) == model.processor.tokenizer.decode(tokens, skip_special_tokens=True)
    assert len(chosen.drop)  # decode steps on both ranks kept them hidden
