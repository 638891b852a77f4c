"""Reuse plans under chunked prefill, on real SGLang CPU workers with small ``--chunked-prefill-size``.

SGLang splits a long prefill into extends of at most that many rows (on a GPU 8K or 16K, by memory), so a large
image's rows, or its question, fall in several extends of one request. Worker A's chunks put each image's rows in
two extends, worker B's in three; both share one store, as workers on one host do. What is checked:

- a miss whose image spans two extends stores what a full prefill computes;
- an exact hit spanning two and three extends answers as the worker's own full prefill (same prefix and moved),
  executed in each extend of the image, without the vision tower;
- an approximate hit spanning three extends, its question in a later one, is executed in each (the same sets
  decided without the question, engine_ext.selection), and answers as the reference executing the same plan;
- an approximate hit whose image and first question rows are in one extend, the rest of the question in the next,
  scores with those rows, and the tokens it drops stay hidden from the next extend and in decode;
- cacheblend, which ranks the whole image's layer-0 K/V, runs as a full prefill there, and says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from offline.reference import Fresh, Reuse, prefill, uniform
from plan import CACHEBLEND, ENTROPY_AWARE, EXACT, MISS, PARTIAL_PASS, ImagePlan
from plan.outcome import FULL_PREFILL, PLANNED, Outcome
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

# Per model: worker A's and worker B's --chunked-prefill-size. The 224x224 picture after "Look:" is prompt rows
# [9, 73) for Qwen2.5-VL (64 tokens), [9, 58) for Qwen3-VL (49): two extends on A, three on B.
CHUNKS = {"qwen2_5_vl": (48, 32), "qwen3_vl": (48, 24)}
SPANS = {"qwen2_5_vl": (2, 3), "qwen3_vl": (2, 3)}
MOVED_PREAMBLE = "Something else came first, and it was long. Look:"


@pytest.fixture(scope="module", params=sorted(CHUNKS))
def pair(request, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    arch = request.param
    a, b = (("--chunked-prefill-size", str(chunk)) for chunk in CHUNKS[arch])
    yield from worker_pair(arch, tiny_models[arch], tmp_path_factory.mktemp(f"chunked-{arch}"), (a, b))


@pytest.fixture(scope="module")
def picture(astronaut: Image.Image) -> Image.Image:
    return astronaut.resize((224, 224))


def extends_of(pair: Pair, worker_index: int, prompt) -> int:
    """How many extends of the worker's chunk size the prompt's first image spans."""
    chunk = CHUNKS[pair.arch][worker_index]
    span = prompt.images[0]
    return (span.stop - 1) // chunk - span.start // chunk + 1


@pytest.fixture(scope="module")
def seen(pair: Pair, picture: Image.Image) -> dict:
    """Worker A answers a miss whose image spans two of its extends, planned to store it."""
    key = key_for(f"{pair.arch}-chunked-astronaut")
    prompt = pair.model.prompt(["Look:", picture, QUESTION])
    assert extends_of(pair, 0, prompt) == SPANS[pair.arch][0] and extends_of(pair, 1, prompt) == SPANS[pair.arch][1]
    grid = grid_of(prompt)
    answer = chat(pair.a, content("Look:", picture, QUESTION),
                  plan_rid=rid(ImagePlan(key=key, kind=MISS, tokens=grid[0] * grid[1], grid=grid)))
    wait_stored(pair, key)
    return {"key": key, "answer": answer, "prompt": prompt, "grid": grid}


def exact_plan(seen: dict, **fields) -> ImagePlan:
    return ImagePlan(key=seen["key"], kind=EXACT, tokens=seen["grid"][0] * seen["grid"][1], grid=seen["grid"],
                     **fields)


def test_a_miss_across_two_extends_stores_what_full_prefill_computes(pair: Pair, seen: dict) -> None:
    prompt, model = seen["prompt"], pair.model
    span = prompt.images[0]
    full = prefill(model, prompt, [Fresh(model.encode(prompt)[0])])
    entry = stored_as_reference(pair, seen["key"], prompt)
    assert torch.equal(entry.positions, prompt.positions[:, span.start : span.stop])
    for layer in range(model.num_layers):
        assert (entry.k[layer] - full.state.k[layer][span.start : span.stop]).abs().max() < 1e-4
        assert (entry.v[layer] - full.state.v[layer][span.start : span.stop]).abs().max() < 1e-4


@pytest.mark.parametrize("which", ["a", "b"])
def test_an_exact_hit_across_extends_answers_as_a_full_prefill(pair: Pair, seen: dict, picture: Image.Image,
                                                               which: str) -> None:
    worker = pair.a if which == "a" else pair.b
    parts = content("Look:", picture, QUESTION)
    hits = f"revisit: exact hit {seen['key'][:16]}"
    hits_before, runs_before = worker.log_file.read_text().count(hits), vision_runs(worker)
    flush(worker)
    plan_rid = rid(exact_plan(seen))
    hit = chat(worker, parts, plan_rid=plan_rid)
    # executed in each extend the image's rows fall in, the vision tower never run on it
    assert worker.log_file.read_text().count(hits) == hits_before + SPANS[pair.arch]["ab".index(which)]
    assert vision_runs(worker) == runs_before
    assert ran(pair, plan_rid) == {0: Outcome(PLANNED)}
    flush(worker)
    full = chat(worker, parts)
    assert text_of(hit) == text_of(full) and text_of(hit)
    assert top5(hit) == pytest.approx(top5(full), abs=1e-5)


def test_a_moved_exact_hit_across_extends_matches_the_reference(pair: Pair, seen: dict, picture: Image.Image) -> None:
    model = pair.model
    moved = model.prompt([MOVED_PREAMBLE, picture, QUESTION])
    assert extends_of(pair, 1, moved) >= 2
    ratios = uniform(0.3, model.num_layers)
    flush(pair.b)
    served = chat(pair.b, content(MOVED_PREAMBLE, picture, QUESTION), plan_rid=rid(exact_plan(seen, ratios=ratios)),
                  tokens=1)
    reference = prefill(model, moved, [Reuse(stored_as_reference(pair, seen["key"], moved), ratios)])
    expected = sorted(reference.logits.log_softmax(-1).topk(5).values.tolist(), reverse=True)
    assert top5(served) == pytest.approx(expected, abs=2e-4)


def test_an_approximate_hit_across_extends_executes_as_the_reference_does(pair: Pair, seen: dict,
                                                                          picture: Image.Image) -> None:
    from engine_ext.executor.approximate import tokens_digest
    from offline.reference import greedy
    from offline.reference.approximate import execute, partial_encoder

    model, image = pair.model, edited(picture)
    prompt = model.prompt([APPROXIMATE_PREAMBLE, image, QUESTION])
    spans = extends_of(pair, 1, prompt)
    assert spans == 3 and prompt.images[0].stop // CHUNKS[pair.arch][1] < (len(prompt) - 1) // CHUNKS[pair.arch][1]
    plan = dataclasses.replace(gateway_plan(pair, seen["key"], picture, image, seen["grid"], ENTROPY_AWARE),
                               key=key_for(f"{pair.arch}-chunked-edited"))
    alias = stored_as_reference(pair, seen["key"], seen["prompt"])
    assert plan.vision == PARTIAL_PASS  # the gateway's default: composed again in each extend of the image
    encoder = partial_encoder(model, prompt, plan, alias)[0]
    approximate, chosen = execute(model, prompt, plan, encoder, alias, question=False)
    # without the question nothing is dropped: B takes every token R does not (engine_ext.selection)
    assert not len(chosen.drop) and len(chosen.reuse) > len(plan.reuse) and len(chosen.recompute)
    reference = prefill(model, prompt, [approximate])
    flush(pair.b)
    hits = f"revisit: approximate hit {plan.key[:16]}"
    before = pair.b.log_file.read_text().count(hits)
    plan_rid = rid(plan)
    served = chat(pair.b, content(APPROXIMATE_PREAMBLE, image, QUESTION), plan_rid=plan_rid, tokens=8)
    lines = [x for x in pair.b.log_file.read_text().splitlines() if hits in x][before:]
    assert len(lines) == spans and all("without the question" in x for x in lines)
    assert all(f"{chosen.summary()}, recomputed {tokens_digest(chosen.recompute)}" in x for x in lines)
    assert ran(pair, plan_rid) == {0: Outcome(PLANNED)}
    expected = sorted(reference.logits.log_softmax(-1).topk(5).values.tolist(), reverse=True)
    assert top5(served) == pytest.approx(expected, abs=2e-4)
    tokens = greedy(model, reference, 8)
    assert text_of(served) == model.processor.tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_question_split_over_extends_scores_with_its_first_rows_and_its_drops_stay_hidden(
    pair: Pair, astronaut: Image.Image
) -> None:
    """A small image whole in worker A's first extend, its question running on into the second: the warmup scores
    with the question's rows in the image's extend, the tokens dropped there stay hidden from the question's later
    rows (the second extend) and in decode, as in the reference."""
    from engine_ext.executor.approximate import tokens_digest
    from offline.reference import greedy
    from offline.reference.approximate import execute, partial_encoder

    model, chunk = pair.model, CHUNKS[pair.arch][0]
    small = astronaut.resize((112, 112))
    question = "What is in the picture? Say it in a few words, please."
    alias_prompt = model.prompt(["Look:", small, question])
    grid = grid_of(alias_prompt)
    alias_key = key_for(f"{pair.arch}-chunked-small")
    chat(pair.a, content("Look:", small, question), tokens=1,
         plan_rid=rid(ImagePlan(key=alias_key, kind=MISS, tokens=grid[0] * grid[1], grid=grid)))
    wait_stored(pair, alias_key)
    image = small.copy()
    ImageDraw.Draw(image).rectangle((2, 2, 20, 20), fill=(20, 20, 20))  # inside the first token
    prompt = model.prompt([APPROXIMATE_PREAMBLE, image, question])
    span = prompt.images[0]
    assert span.stop < chunk < len(prompt)  # the image and the question's first rows in one extend, the rest after
    plan = dataclasses.replace(gateway_plan(pair, alias_key, small, image, grid, ENTROPY_AWARE),
                               key=key_for(f"{pair.arch}-chunked-small-edited"))
    alias = stored_as_reference(pair, alias_key, alias_prompt)
    encoder = partial_encoder(model, prompt, plan, alias)[0] if plan.vision == PARTIAL_PASS else model.encode(prompt)[0]
    approximate, chosen = execute(model, prompt, plan, encoder, alias, asking_until=chunk)
    assert len(chosen.drop)  # hidden from the second extend's rows at layers >= W
    reference = prefill(model, prompt, [approximate])
    flush(pair.a)
    hits = f"revisit: approximate hit {plan.key[:16]}"
    before = pair.a.log_file.read_text().count(hits)
    plan_rid = rid(plan)
    served = chat(pair.a, content(APPROXIMATE_PREAMBLE, image, question), plan_rid=plan_rid, tokens=8)
    lines = [x for x in pair.a.log_file.read_text().splitlines() if hits in x][before:]
    assert len(lines) == 1 and "without the question" not in lines[0]
    assert f"{chosen.summary()}, recomputed {tokens_digest(chosen.recompute)}" in lines[0]
    assert ran(pair, plan_rid) == {0: Outcome(PLANNED)}
    expected = sorted(reference.logits.log_softmax(-1).topk(5).values.tolist(), reverse=True)
    assert top5(served) == pytest.approx(expected, abs=2e-4)
    tokens = greedy(model, reference, 8)
    assert text_of(served) == model.processor.tokenizer.decode(tokens, skip_special_tokens=True)


def test_cacheblend_across_extends_runs_as_a_full_prefill(pair: Pair, seen: dict, picture: Image.Image) -> None:
    image = edited(picture, shade=40)
    plan = dataclasses.replace(gateway_plan(pair, seen["key"], picture, image, seen["grid"], CACHEBLEND),
                               key=key_for(f"{pair.arch}-chunked-cacheblend"))
    parts = content(APPROXIMATE_PREAMBLE, image, QUESTION)
    flush(pair.b)
    plan_rid = rid(plan)
    served = chat(pair.b, parts, plan_rid=plan_rid, tokens=8)
    assert ran(pair, plan_rid) == {0: Outcome(FULL_PREFILL, "chunked")}
    flush(pair.b)
    full = chat(pair.b, parts, tokens=8)
    assert text_of(served) == text_of(full) and top5(served) == pytest.approx(top5(full), abs=1e-5)
