"""Reuse plans executed by real SGLang CPU workers, checked against full prefill and the reference.

Two workers per model family share one store (shared-memory files + LMDB in a temporary directory), as workers on
one host do: worker A makes an entry on a miss; worker B, which has never seen the image, reuses it, so its vision
tower provably does not run (SGLang's own encoder cache cannot have the image).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from bundled import ARCHS
from engine_ext.executor import read
from offline.reference import Fresh, Reuse, prefill, uniform
from plan import (
    ATTENTION_ONLY,
    CACHEBLEND,
    ENTROPY_AWARE,
    EXACT,
    FULL_PASS,
    FULL_REUSE,
    MISS,
    PARTIAL_PASS,
    PUBLIC_PLAN_KEY,
    RID_PREFIX,
    SELECTORS,
    ImagePlan,
    RequestPlan,
)
from plan.outcome import EVERY_IMAGE, FULL_PREFILL, PLANNED, UNPLANNED, Outcome
from store.entry import parse_header
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

RATIOS = (0.0, 0.3, 1.0)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    arch = request.param
    yield from worker_pair(arch, tiny_models[arch], tmp_path_factory.mktemp(f"reuse-{arch}"))


@pytest.fixture(scope="module")
def picture(astronaut: Image.Image) -> Image.Image:
    return astronaut.resize((224, 224))


@pytest.fixture(scope="module")
def seen(pair: Pair, picture: Image.Image) -> dict:
    """Worker A answers a miss planned to store the image under a key; returns the key and A's answer."""
    key = key_for(f"{pair.arch}-astronaut")
    prompt = pair.model.prompt(["Look:", picture, QUESTION])
    grid = grid_of(prompt)
    answer = chat(pair.a, content("Look:", picture, QUESTION),
                  plan_rid=rid(ImagePlan(key=key, kind=MISS, tokens=grid[0] * grid[1], grid=grid)))
    wait_stored(pair, key)
    return {"key": key, "answer": answer, "prompt": prompt, "grid": grid}


def test_a_miss_stores_what_full_prefill_computes(pair: Pair, seen: dict) -> None:
    prompt, model = seen["prompt"], pair.model
    span = prompt.images[0]
    full = prefill(model, prompt, [Fresh(model.encode(prompt)[0])])
    entry = stored_as_reference(pair, seen["key"], prompt)
    assert torch.equal(entry.positions, prompt.positions[:, span.start : span.stop])
    for layer in range(model.num_layers):
        assert (entry.k[layer] - full.state.k[layer][span.start : span.stop]).abs().max() < 1e-4
        assert (entry.v[layer] - full.state.v[layer][span.start : span.stop]).abs().max() < 1e-4
    assert (entry.encoder.flat() - model.encode(prompt)[0].flat()).abs().max() < 1e-4
    assert f"revisit: stored {seen['key'][:16]}" in pair.a.log_file.read_text()


def test_exact_hit_same_prefix_is_token_identical_and_skips_the_vision_tower(
    pair: Pair, seen: dict, picture: Image.Image
) -> None:
    before = vision_runs(pair.b)
    hits_before = pair.b.log_file.read_text().count(f"revisit: exact hit {seen['key'][:16]}")
    plan = ImagePlan(key=seen["key"], kind=EXACT, tokens=seen["grid"][0] * seen["grid"][1], grid=seen["grid"])
    flush(pair.b)
    hit = chat(pair.b, content("Look:", picture, QUESTION), plan_rid=rid(plan))
    assert text_of(hit) == text_of(seen["answer"]) and text_of(hit)
    assert top5(hit) == pytest.approx(top5(seen["answer"]), abs=1e-5)
    assert vision_runs(pair.b) == before  # worker B never ran its vision tower on this image
    assert pair.b.log_file.read_text().count(f"revisit: exact hit {seen['key'][:16]}") == hits_before + 1


@pytest.mark.parametrize("ratio", RATIOS)
def test_position_independent_reuse_matches_the_reference(
    pair: Pair, seen: dict, picture: Image.Image, ratio: float
) -> None:
    preamble = "Something else came first, and it was long. Look:"
    model = pair.model
    moved = model.prompt([preamble, picture, QUESTION])
    ratios = uniform(ratio, model.num_layers)
    plan = ImagePlan(key=seen["key"], kind=EXACT, tokens=seen["grid"][0] * seen["grid"][1], grid=seen["grid"],
                     ratios=ratios)
    flush(pair.b)
    served = chat(pair.b, content(preamble, picture, QUESTION), plan_rid=rid(plan), tokens=1)
    reference = prefill(model, moved, [Reuse(stored_as_reference(pair, seen["key"], moved), ratios)])
    expected = sorted(reference.logits.log_softmax(-1).topk(5).values.tolist(), reverse=True)
    assert top5(served) == pytest.approx(expected, abs=2e-4)
    if ratio == 1.0:  # everything recomputed: a full prefill
        flush(pair.b)
        full = chat(pair.b, content(preamble, picture, QUESTION), tokens=1)
        assert top5(served) == pytest.approx(top5(full), abs=2e-4)


def test_two_images_only_the_seen_one_is_reused(
    pair: Pair, seen: dict, picture: Image.Image, coffee: Image.Image
) -> None:
    other = coffee.resize((224, 224))
    parts = content("Look:", picture, "and then:", other, "Which is brighter?")
    grid = seen["grid"]
    new_key = key_for(f"{pair.arch}-coffee")
    plans = (ImagePlan(key=seen["key"], kind=EXACT, tokens=grid[0] * grid[1], grid=grid),
             ImagePlan(key=new_key, kind=MISS, tokens=grid[0] * grid[1], grid=grid))
    before, log_before = vision_runs(pair.b), pair.b.log_file.read_text().count("revisit: exact hit")
    flush(pair.b)
    planned = chat(pair.b, parts, plan_rid=rid(*plans))
    assert vision_runs(pair.b) == before + 1  # only the new image was encoded
    assert pair.b.log_file.read_text().count("revisit: exact hit") == log_before + 1
    wait_stored(pair, new_key)
    flush(pair.b)
    assert text_of(planned) == text_of(chat(pair.b, parts))  # the first image sits after the same text


# Damage to the header or the encoder output is found before the forward: the plan becomes a full prefill. Damage
# to K/V blocks is found when their rows' read comes in: those rows are computed from then on, as a full prefill
# computes them.
DAMAGE = {"kv": ("stored K/V of", Outcome(PLANNED, "kv_read_failed")),
          "encoder": ("runs as a full prefill: entry_damaged", Outcome(FULL_PREFILL, "entry_damaged"))}


@pytest.mark.parametrize("where", DAMAGE)
def test_a_damaged_entry_falls_back_to_full_prefill(pair: Pair, picture: Image.Image, where: str) -> None:
    key = key_for(f"{pair.arch}-astronaut-damaged-{where}")
    prompt = pair.model.prompt(["Look:", picture, QUESTION])
    grid = grid_of(prompt)
    plan = ImagePlan(key=key, kind=MISS, tokens=grid[0] * grid[1], grid=grid)
    chat(pair.a, content("Look:", picture, QUESTION), plan_rid=rid(plan), tokens=1)
    wait_stored(pair, key)
    store = pair.store()
    entry_file = Path(pair.store_env["REVISIT_STORE_DRAM_DIR"]) / f"{key}.kv"
    data = bytearray(entry_file.read_bytes())
    offset = -10 if where == "kv" else parse_header(memoryview(data)).header.encoder_range.start + 5
    data[offset] ^= 0xFF  # inside the KV of the last token, or the encoder output of the first
    entry_file.write_bytes(bytes(data))
    assert store.get(key) is None
    exact = ImagePlan(key=key, kind=EXACT, tokens=grid[0] * grid[1], grid=grid)
    flush(pair.b)
    line, outcome = DAMAGE[where]
    seen_before = pair.b.log_file.read_text().count(line)
    exact_rid = rid(exact)
    answer = chat(pair.b, content("Other words. Look:", picture, QUESTION), plan_rid=exact_rid, tokens=8)
    flush(pair.b)
    assert text_of(answer) == text_of(chat(pair.b, content("Other words. Look:", picture, QUESTION), tokens=8))
    assert pair.b.log_file.read_text().count(line) == seen_before + 1
    assert ran(pair, exact_rid) == {0: outcome}  # what the gateway is told ran


def test_a_plan_that_does_not_fit_is_ignored(pair: Pair, seen: dict, picture: Image.Image) -> None:
    wrong = ImagePlan(key=seen["key"], kind=EXACT, tokens=6, grid=(2, 3))
    flush(pair.b)
    mismatches = pair.b.log_file.read_text().count("does not match its image")
    wrong_rid = rid(wrong)
    answer = chat(pair.b, content("Look:", picture, QUESTION), plan_rid=wrong_rid)
    assert text_of(answer) == text_of(seen["answer"])
    assert pair.b.log_file.read_text().count("does not match its image") == mismatches + 1
    assert ran(pair, wrong_rid) == {0: Outcome(UNPLANNED, "plan_mismatch")}
    bad_rid = f"{RID_PREFIX}{uuid.uuid4().hex}.not-a-plan."
    bad = chat(pair.b, content("Look:", picture, QUESTION), plan_rid=bad_rid, tokens=2)
    assert bad["choices"][0]["message"]["content"]
    assert ran(pair, bad_rid) == {EVERY_IMAGE: Outcome(UNPLANNED, "plan_refused")}



def test_the_encoder_cache_is_kept_apart_per_tenant_scope(pair: Pair, picture: Image.Image) -> None:
    """SGLang's encoder-output cache serves the same pixels to the same scope only: another namespace's request
    runs the vision tower itself (so it can neither be served nor time the first one's embeddings)."""
    from PIL import ImageDraw

    image = picture.copy()
    ImageDraw.Draw(image).ellipse((90, 90, 150, 150), fill=(10, 200, 30))  # pixels no other test sent
    grid = grid_of(pair.model.prompt(["Look:", image, QUESTION]))

    def scoped(scope: str) -> str:
        plan = ImagePlan(key=key_for(f"{pair.arch}-scoped"), kind=MISS, tokens=grid[0] * grid[1], grid=grid,
                         store=False)
        return RequestPlan(images=(plan,), scope=scope).to_rid(uuid.uuid4().hex, key=PUBLIC_PLAN_KEY)

    answers, runs, rids = [], [vision_runs(pair.b)], []
    for scope in ("revisit-ns-a", "revisit-ns-a", "revisit-ns-b"):
        flush(pair.b)  # the radix cache only: SGLang keeps its encoder cache
        rids.append(scoped(scope))
        answers.append(text_of(chat(pair.b, content("Look:", image, QUESTION), plan_rid=rids[-1], tokens=6)))
        runs.append(vision_runs(pair.b))
    assert [b - a for a, b in zip(runs, runs[1:], strict=False)] == [1, 0, 1]  # a's repeat hit, b's did not
    assert answers[0] == answers[1] == answers[2]
    assert [ran(pair, r) for r in rids] == [None] * 3  # unstored misses are not reported: no gateway reads them

# --- approximate plans ---

@pytest.mark.parametrize(("selector", "vision", "rho"), [(s, FULL_PASS, None) for s in SELECTORS] + [
    (ENTROPY_AWARE, PARTIAL_PASS, None), (CACHEBLEND, PARTIAL_PASS, None), (ATTENTION_ONLY, FULL_PASS, 0.01)])
def test_an_approximate_hit_executes_as_the_reference_does(pair: Pair, seen: dict, picture: Image.Image,
                                                           selector: str, vision: str, rho: float | None) -> None:
    """Every selector, with the full and the partial vision pass, and a tight budget (rho below the changed
    share: the changed tokens the question needs recomputed, the others dropped)."""
    from engine_ext.executor.approximate import tokens_digest
    from engine_ext.selection import tight
    from offline.reference import greedy
    from offline.reference.approximate import execute, partial_encoder

    # a partial pass runs only where SGLang's encoder cache does not hold the image: a box no other test drew
    shade = 20 if vision == FULL_PASS else 30 + SELECTORS.index(selector)
    model, image = pair.model, edited(picture, shade)
    prompt = model.prompt([APPROXIMATE_PREAMBLE, image, QUESTION])
    plan = dataclasses.replace(gateway_plan(pair, seen["key"], picture, image, seen["grid"], selector),
                               vision=vision, key=key_for(f"{pair.arch}-edited-{shade}-{rho}"))
    if rho is not None:
        plan = dataclasses.replace(plan, recompute_share=rho)
        assert tight(plan) and plan.change_map.count("x") > 1
    alias = stored_as_reference(pair, seen["key"], seen["prompt"])
    if vision == PARTIAL_PASS:
        encoder, encoded = partial_encoder(model, prompt, plan, alias)
        assert 0 < encoded < plan.tokens
    else:
        encoder = model.encode(prompt)[0]
    approximate, chosen = execute(model, prompt, plan, encoder, alias)
    reference = prefill(model, prompt, [approximate])
    flush(pair.b)
    log_before = pair.b.log_file.read_text().count("revisit: approximate hit")
    runs_before = vision_runs(pair.b)
    served = chat(pair.b, content(APPROXIMATE_PREAMBLE, image, QUESTION), plan_rid=rid(plan), tokens=8)
    log = pair.b.log_file.read_text()
    assert log.count("revisit: approximate hit") == log_before + 1
    if vision == PARTIAL_PASS:  # the full tower never ran on the new image; the partial pass did, as planned
        assert vision_runs(pair.b) == runs_before
        assert f"partial vision pass for {plan.key[:16]}: {encoded} of {plan.tokens} tokens encoded" in log
    line = [x for x in log.splitlines() if "revisit: approximate hit" in x][-1]
    assert f"{chosen.summary()}, recomputed {tokens_digest(chosen.recompute)}" in line  # the same R, B and D
    expected = sorted(reference.logits.log_softmax(-1).topk(5).values.tolist(), reverse=True)
    assert top5(served) == pytest.approx(expected, abs=2e-4)
    # decoding goes on with the dropped tokens hidden, as in the reference
    tokens = greedy(model, reference, 8)
    assert text_of(served) == model.processor.tokenizer.decode(tokens, skip_special_tokens=True)
    if selector == ENTROPY_AWARE or rho is not None:
        assert len(chosen.drop) and "Traceback" not in log


def test_an_approximate_hit_is_stored_as_a_derived_entry_and_its_repeat_answers_as_it_did(
    pair: Pair, seen: dict, picture: Image.Image
) -> None:
    """What an approximate hit computed (nothing dropped) is stored as a derived entry naming its alias: the K/V
    and encoder output the reference computes for the plan; the image's next sight, an exact hit on it, answers
    as the approximate hit did. A selector that drops tokens leaves no entry."""
    from offline.reference.approximate import execute, partial_encoder
    from tests.conftest import worker_events

    model, image = pair.model, edited(picture, 90)  # a box no other test drew: SGLang's encoder cache lacks it
    prompt = model.prompt([APPROXIMATE_PREAMBLE, image, QUESTION])
    plan = dataclasses.replace(gateway_plan(pair, seen["key"], picture, image, seen["grid"], ATTENTION_ONLY),
                               vision=PARTIAL_PASS, key=key_for(f"{pair.arch}-derived"))
    assert plan.derive  # the gateway's default
    alias = stored_as_reference(pair, seen["key"], seen["prompt"])
    encoder, _ = partial_encoder(model, prompt, plan, alias)
    approximate, chosen = execute(model, prompt, plan, encoder, alias)
    assert not len(chosen.drop) and len(chosen.reuse)
    reference = prefill(model, prompt, [approximate])
    flush(pair.b)
    served = chat(pair.b, content(APPROXIMATE_PREAMBLE, image, QUESTION), plan_rid=rid(plan), tokens=8)
    wait_stored(pair, plan.key)
    store = pair.store()
    try:
        with store.get_sparse(plan.key, [], (0, 1)) as head:  # type: ignore[union-attr]
            assert head.header.derived_from == seen["key"]
            assert f"selector={ATTENTION_ONLY}" in head.header.derivation
    finally:
        store.close()
    entry = stored_as_reference(pair, plan.key, prompt)
    span = prompt.images[0]
    for layer in range(model.num_layers):
        assert (entry.k[layer] - reference.state.k[layer][span.start : span.stop]).abs().max() < 2e-4
        assert (entry.v[layer] - reference.state.v[layer][span.start : span.stop]).abs().max() < 2e-4
    assert (entry.encoder.flat() - encoder.flat()).abs().max() < 1e-4
    flush(pair.a)
    repeat = chat(pair.a, content(APPROXIMATE_PREAMBLE, image, QUESTION), tokens=8, plan_rid=rid(
        ImagePlan(key=plan.key, kind=EXACT, tokens=plan.tokens, grid=plan.grid)))
    assert text_of(repeat) == text_of(served) and top5(repeat) == pytest.approx(top5(served), abs=1e-5)
    # entropy_aware drops tokens: what the hit attended to is not a whole image's K/V, so nothing is stored
    dropping = dataclasses.replace(gateway_plan(pair, seen["key"], picture, image, seen["grid"], ENTROPY_AWARE),
                                   vision=FULL_PASS, key=key_for(f"{pair.arch}-derived-dropping"))
    before = worker_events([pair.b.url])
    flush(pair.b)
    chat(pair.b, content(APPROXIMATE_PREAMBLE, image, QUESTION), plan_rid=rid(dropping), tokens=1)
    events = worker_events([pair.b.url]) - before
    assert events["derive_skipped"] == 1 and events["derived_stored"] == 0 and not pair.store().contains(dropping.key)


def test_an_approximate_plan_whose_alias_is_gone_runs_as_a_full_prefill_and_stores(
    pair: Pair, picture: Image.Image
) -> None:
    image = edited(picture)
    prompt = pair.model.prompt([APPROXIMATE_PREAMBLE, image, QUESTION])
    grid = grid_of(prompt)
    plan = gateway_plan(pair, key_for(f"{pair.arch}-never-stored"), picture, image, grid, ENTROPY_AWARE)
    plan = dataclasses.replace(plan, key=key_for(f"{pair.arch}-edited-fallback"))
    flush(pair.b)
    before = pair.b.log_file.read_text().count("runs as a full prefill: entry_missing")
    plan_rid = rid(plan)
    served = chat(pair.b, content(APPROXIMATE_PREAMBLE, image, QUESTION), plan_rid=plan_rid, tokens=8)
    assert pair.b.log_file.read_text().count("runs as a full prefill: entry_missing") == before + 1
    assert ran(pair, plan_rid) == {0: Outcome(FULL_PREFILL, "entry_missing")}
    flush(pair.b)
    full = chat(pair.b, content(APPROXIMATE_PREAMBLE, image, QUESTION), tokens=8)
    assert text_of(served) == text_of(full) and top5(served) == pytest.approx(top5(full), abs=1e-5)
    wait_stored(pair, plan.key)  # computed exactly, so stored as a miss would be


def test_an_approximate_plan_with_a_damaged_alias_computes_the_image_in_full(pair: Pair, picture: Image.Image) -> None:
    alias_key = key_for(f"{pair.arch}-astronaut-alias-damaged")
    alias_prompt = pair.model.prompt(["Look:", picture, QUESTION])
    grid = grid_of(alias_prompt)
    chat(pair.a, content("Look:", picture, QUESTION), tokens=1,
         plan_rid=rid(ImagePlan(key=alias_key, kind=MISS, tokens=grid[0] * grid[1], grid=grid)))
    wait_stored(pair, alias_key)
    entry_file = Path(pair.store_env["REVISIT_STORE_DRAM_DIR"]) / f"{alias_key}.kv"
    data = bytearray(entry_file.read_bytes())
    data[-10] ^= 0xFF  # the last layers of the last token: inside every plan's read unless that token is dropped
    entry_file.write_bytes(bytes(data))
    image = edited(picture)
    plan = gateway_plan(pair, alias_key, picture, image, grid, FULL_REUSE)  # B = every aligned token
    flush(pair.b)
    before = pair.b.log_file.read_text().count("runs as a full prefill: kv_read_failed")
    plan_rid = rid(plan)
    served = chat(pair.b, content(APPROXIMATE_PREAMBLE, image, QUESTION), plan_rid=plan_rid, tokens=8)
    assert pair.b.log_file.read_text().count("runs as a full prefill: kv_read_failed") == before + 1
    assert ran(pair, plan_rid) == {0: Outcome(FULL_PREFILL, "kv_read_failed")}
    flush(pair.b)
    full = chat(pair.b, content(APPROXIMATE_PREAMBLE, image, QUESTION), tokens=8)
    assert text_of(served) == text_of(full) and top5(served) == pytest.approx(top5(full), abs=1e-4)


def test_a_scrolled_alias_lends_its_tokens_moved_per_axis_as_the_reference_does(pair: Pair,
                                                                                 picture: Image.Image) -> None:
    from offline.reference.approximate import execute

    # The alias shows one more token row on top; the new image is the picture alone: its token (r, c) is the
    # alias' (r + 1, c), so their height positions differ by one more than their width positions.
    cell = 28 if pair.arch == "qwen2_5_vl" else 32
    taller = Image.new("RGB", (picture.width, picture.height + cell), (250, 250, 250))
    taller.paste(picture, (0, cell))
    model = pair.model
    alias_prompt = model.prompt(["Look:", taller, QUESTION])
    alias_grid = grid_of(alias_prompt)
    alias_key = key_for(f"{pair.arch}-taller")
    chat(pair.a, content("Look:", taller, QUESTION), tokens=1, plan_rid=rid(
        ImagePlan(key=alias_key, kind=MISS, tokens=alias_grid[0] * alias_grid[1], grid=alias_grid)))
    wait_stored(pair, alias_key)
    prompt = model.prompt([APPROXIMATE_PREAMBLE, picture, QUESTION])
    grid = grid_of(prompt)
    plan = dataclasses.replace(gateway_plan(pair, alias_key, taller, picture, grid, ENTROPY_AWARE, alias_grid),
                               key=key_for(f"{pair.arch}-scrolled"), vision=FULL_PASS)
    assert plan.shift == (-1, 0) and plan.alias_grid == alias_grid and plan.change_map.count("x") == 0
    alias = stored_as_reference(pair, alias_key, alias_prompt)
    approximate, chosen = execute(model, prompt, plan, model.encode(prompt)[0], alias)
    reference = prefill(model, prompt, [approximate])
    flush(pair.b)
    served = chat(pair.b, content(APPROXIMATE_PREAMBLE, picture, QUESTION), plan_rid=rid(plan), tokens=1)
    assert len(chosen.reuse) > 0
    expected = sorted(reference.logits.log_softmax(-1).topk(5).values.tolist(), reverse=True)
    assert top5(served) == pytest.approx(expected, abs=2e-4)


# --- a video's temporal patches ---
# Frames coded losslessly: the same frame decodes to the same pixels in any video, so a later window's first
# patches are the earlier window's last ones (the gateway's patch keys would say so). At 2 frames a second the
# model samples every frame: six frames are three patches.

def window(first: int, frames: int = 6) -> bytes:
    from tests.videos_lib import encode_video, pan

    return encode_video(pan("astronaut.png", frames=frames, start=first), fps=2, lossless=True)


def patches_of(pair: Pair, video: bytes) -> tuple[list[str], tuple[int, int]]:
    """The gateway's key of each temporal patch of the video, and the patches' token grid."""
    from gateway.config import ProcessorSettings, VideoSettings
    from gateway.videos import open_video, patch_grid

    processor = ProcessorSettings.from_model_dir(pair.a.spec.model_path)
    opened = open_video(video, settings=VideoSettings(), processor=processor, model="m", namespace="")
    grid = patch_grid(opened.height, opened.width, len(opened.frame_keys), processor)
    return [patch.key for patch in opened.patches], grid


def video_parts(video: bytes, question: str = "What happens in the video?") -> list[dict]:
    import base64

    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    return [{"type": "text", "text": "Watch:"}, {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": question}]


def patch_plans(keys: list[str], grid: tuple[int, int], kinds: list[str]) -> tuple[ImagePlan, ...]:
    return tuple(ImagePlan(key=key, kind=kind, tokens=grid[0] * grid[1], grid=grid)
                 for key, kind in zip(keys, kinds, strict=True))


def video_rid(*patches: ImagePlan) -> str:
    return RequestPlan(patches=patches).to_rid(uuid.uuid4().hex, key=PUBLIC_PLAN_KEY)


@pytest.fixture(scope="module")
def first_window(pair: Pair) -> dict:
    """Worker A computes the first window as a miss of each of its patches, stored under the patches' keys."""
    video = window(0)
    keys, grid = patches_of(pair, video)
    assert len(keys) == 3 and len(set(keys)) == 3
    plan_rid = video_rid(*patch_plans(keys, grid, [MISS] * 3))
    answer = chat(pair.a, video_parts(video), plan_rid=plan_rid)
    for key in keys:
        wait_stored(pair, key)
    assert ran(pair, plan_rid) == {0: Outcome(PLANNED), 1: Outcome(PLANNED), 2: Outcome(PLANNED)}
    return {"video": video, "keys": keys, "grid": grid, "answer": answer}


def test_a_videos_patches_are_stored_one_entry_each_and_reused_exactly(pair: Pair, first_window: dict) -> None:
    keys, grid = first_window["keys"], first_window["grid"]
    m = pair.model
    stored = [read(pair.store(), key, model_id=pair.a.spec.model_path.name, layers=m.num_layers, kv_heads=m.kv_heads,
                   head_dim=m.head_dim, tokens=grid[0] * grid[1]) for key in keys]
    assert all(s is not None and s.encoder.shape[0] == grid[0] * grid[1] for s in stored)
    positions = [s.positions for s in stored if s is not None]  # (3, tokens) each: time, height, width
    # each patch laid out as the first (token (r, c) at height and width r and c past its first token's), its tokens
    # at one time position, later patches at later or equal positions (Qwen2.5-VL: the patch's index x seconds a
    # patch x tokens a second, rounded down; Qwen3-VL: a timestamp's text between patches moves every axis)
    layout = [p[1:] - p[1:, :1] for p in positions]
    assert all(torch.equal(grid_positions, layout[0]) for grid_positions in layout)
    assert all((p[0] == p[0, 0]).all() for p in positions)
    assert [int(p[0, 0]) for p in positions] == sorted(int(p[0, 0]) for p in positions)
    # B never saw the video: each patch's K/V read from the store in place of its own, at every layer
    flush(pair.b)
    plan_rid = video_rid(*patch_plans(keys, grid, [EXACT] * 3))
    hit = chat(pair.b, video_parts(first_window["video"]), plan_rid=plan_rid)
    assert ran(pair, plan_rid) == {0: Outcome(PLANNED), 1: Outcome(PLANNED), 2: Outcome(PLANNED)}
    assert pair.b.log_file.read_text().count("video patch rows, moved by 0,") >= 3
    assert text_of(hit) == text_of(first_window["answer"]) and text_of(hit)
    assert top5(hit) == pytest.approx(top5(first_window["answer"]), abs=1e-5)


def test_a_plan_with_other_patches_than_the_video_runs_unplanned(pair: Pair, first_window: dict) -> None:
    keys, grid = first_window["keys"], first_window["grid"]
    flush(pair.b)
    plan_rid = video_rid(*patch_plans(keys[:2], grid, [EXACT] * 2))  # the video has three
    served = chat(pair.b, video_parts(first_window["video"]), plan_rid=plan_rid)
    assert ran(pair, plan_rid) == {0: Outcome(PLANNED), 1: Outcome(PLANNED), 2: Outcome(UNPLANNED, "plan_mismatch")}
    assert text_of(served) == text_of(first_window["answer"])


def test_a_plan_without_patches_leaves_the_video_alone(pair: Pair, first_window: dict) -> None:
    """What a gateway sends a video's request when it plans no patch (the tenant's scope alone): the video runs as
    in SGLang, with nothing reported or counted as a mismatch."""
    from tests.conftest import worker_events

    before = worker_events([pair.b.url])
    flush(pair.b)
    plan_rid = RequestPlan(scope="video-tenant").to_rid(uuid.uuid4().hex, key=PUBLIC_PLAN_KEY)
    served = chat(pair.b, video_parts(first_window["video"]), plan_rid=plan_rid)
    events = worker_events([pair.b.url]) - before
    assert events["plan_mismatch"] == 0 and ran(pair, plan_rid) is None
    assert text_of(served) == text_of(first_window["answer"])
