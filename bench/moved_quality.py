"""Is reusing K/V safe for content moved by part of a token? The reading model that depends on late-layer image KV
(the oracle) decides, through the reference (offline.reference.approximate: the rule the workers run).

    .venv/bin/python bench/moved_quality.py [--pairs 100] [--offsets 0 1 2 ...] [--split [--split-pan PX]]
                                            [--trained NAME] [--json FILE]

For each offset k (pixels the content moved: a page scrolled, its content up by k; a frame panned, its content
left by k; whole tokens plus a remainder too) and each pair of offline.reader_eval (A cached; B = A with one field
given another value), A is the panel below (scroll) or right of (pan) a blank band of BAND cells of its background,
B the same with its content moved by k pixels into the band (bundled.reader.panels.Placement), so every field stays
in view; B is asked about its changed field and an unchanged one:

    full     B from scratch: the bar (the reader itself reads a moved panel less well than an aligned one)
    moved    B planned as the gateway would plan a known motion: each B token lines up with the A token its pixels
             mostly come from (the motion rounded to whole tokens: the plan's shift), whose K/V it reuses with the
             keys moved to B's positions; the tokens whose pixels differ from A's content moved the same way (the
             revalued field; tokens with no A token) are changed and recomputed, with the share the selector adds
             (attention_only, rho 0.3 widened to the changed share, W 3, B's own encoder output)
    gateway  B as the gateway plans it (below), over the pairs it plans: its own change map and shift; beside it
             the full prefill's answers on those same pairs

``--split`` puts two motions in one image instead (a camera's with parallax, a page scrolled under a fixed
header): B's top half (down to the middle token row) shows the content panned by SPLIT_PAN px (``--split-pan``),
its bottom half the content scrolled by the offset (up under the top half), A the panel unmoved; the bench's plan
keeps every token where it is (each motion under half a token) and marks changed what differs from A moved the
same way, half by half; the gateway plans such images region by region (gateway/matching/moved.py, find_regions;
a top half panned past the horizontal bound is out of reach there: recomputed where it changed).

Beside each offset, what the gateway plans for B with A stored (its pixel features, the coarse and fine stages, the
sub-token move of gateway/matching/moved.py and the guard at the default settings): the share of pairs planned
approximate. The offsets it plans should be those where reuse holds.

A changed-field answer with A's value is "stale": the moved K/V were read as they are. An offset is safe to plan
where ``moved`` is within 2 points of ``full`` on both kinds of question, and only where ``full`` itself reads B
(at least READABLE right on both): where the reader cannot read a moved panel at all, agreeing with it says nothing,
and the offset gets no verdict.

The judge is the oracle fine-tuned on moved panels (``--trained qwen2_5_vl-oracle-moved``, bundled.reader.train's
``--moved``): the committed oracle, trained on the token grid only, reads a panel moved by 1 px right 27-35% of
the time and by 2 px 15%, so it can judge no offset but 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bundled import ORACLE, QWEN2_5_VL  # noqa: E402
from bundled.build import build_recipe  # noqa: E402
from bundled.reader.panels import CELL, MAX_SIDE, Placement  # noqa: E402
from bundled.reader.questions import field  # noqa: E402
from bundled.recipes import MOVED_ORACLE, get_recipe  # noqa: E402
from gateway.config import MatchSettings  # noqa: E402
from gateway.matching.matcher import Matcher  # noqa: E402
from gateway.matching.moved import MovedImage  # noqa: E402
from gateway.matching.pixel import PixelExtractor  # noqa: E402
from gateway.matching.plans import approximate_plan  # noqa: E402
from offline.reader_eval import CHANGED, UNCHANGED, Tally, answer_ids, make_pairs  # noqa: E402
from offline.reference import Approximate, Fresh, ReferenceModel, capture, prefill  # noqa: E402
from offline.reference.approximate import execute  # noqa: E402
from plan import APPROXIMATE, ATTENTION_ONLY, ImagePlan  # noqa: E402

OFFSETS = (0, 1, 2, 3, 5, 7, 10, 13, 14, 15, 18, 21, 24, 25, 26, 27, 28, 29, 30, 33, 41, 42, 43, 54, 55, 56)
DIRECTIONS = ("scroll", "pan")
SPLIT = "split"  # two motions in one image: the top half's content panned by SPLIT_PAN, the bottom half's scrolled
SPLIT_PAN = 3  # pixels the top half's content is panned left by, in a split
SPLIT_OFFSETS = (0, 1, 3, 5, 7, 10, 13)  # a split's scroll stays under half a token: no whole-token shift
BAND = 2  # blank cells the content can move into: offsets up to BAND * CELL keep every field in view
CHANGED_LEVEL = 24  # a token is changed where a pixel differs from A's moved content by more (as the labelled set)
RHO, WARMUP = 0.3, 3
READABLE = 90.0  # % of a full prefill's answers right, on both kinds, for an offset to get a verdict


def placement(direction: str, offset: int) -> Placement:
    """Where a panel's content is drawn after moving up (scroll) or left (pan) by ``offset`` pixels from BAND blank
    cells in."""
    if not 0 <= offset <= BAND * CELL:
        raise ValueError(f"offset {offset} px: 0 to {BAND * CELL} keep the panel in view")
    rest = BAND * CELL - offset
    return Placement(top=rest, pad=(BAND, 0)) if direction == "scroll" else Placement(left=rest, pad=(0, BAND))


def cached_view(direction: str, panel) -> Image.Image:
    """A as cached: the panel where BAND blank cells put it (both ways for a split)."""
    if direction == SPLIT:
        return Placement(top=BAND * CELL, left=BAND * CELL, pad=(BAND, BAND)).render(panel)
    return placement(direction, 0).render(panel)


def moved_view(direction: str, offset: int, panel, split_pan: int = SPLIT_PAN) -> Image.Image:
    """The panel's content moved by ``offset`` px (a scroll or a pan), or, in a split, the top half of the image
    panned by ``split_pan`` and the bottom half (from the middle token row) scrolled by ``offset``, under the top half
    (a strip of ``offset`` px hidden at the seam, as under a page's fixed header): two motions, each within the
    bounds planned for one."""
    if direction != SPLIT:
        return placement(direction, offset).render(panel)
    if not 0 <= offset < CELL // 2:
        raise ValueError(f"a split's scroll of {offset} px: 0 to {CELL // 2 - 1} (under half a token)")
    rest = BAND * CELL
    top = Placement(top=rest, left=rest - split_pan, pad=(BAND, BAND)).render(panel)
    image = Placement(top=rest - offset, left=rest, pad=(BAND, BAND)).render(panel)
    middle = image.height // CELL // 2 * CELL
    image.paste(top.crop((0, 0, top.width, middle)), (0, 0))
    return image


def moved_plan(a_moved: Image.Image, b_image: Image.Image, grid: tuple[int, int], direction: str,
               offset: int) -> ImagePlan:
    """The approximate plan of B against A under the known motion (see the module docstring)."""
    rows, cols = grid
    whole = round(offset / CELL)  # a split's scroll: none
    shift = (-whole, 0) if direction == "scroll" else (0, -whole)
    diff = np.abs(np.asarray(b_image, np.int16) - np.asarray(a_moved, np.int16)).max(axis=2)
    differs = diff.reshape(rows, CELL, cols, CELL).max(axis=(1, 3)).reshape(-1) > CHANGED_LEVEL
    probe = ImagePlan(key="1" * 64, kind=APPROXIMATE, tokens=rows * cols, grid=grid, alias="0" * 64, shift=shift,
                      change_map="~" * (rows * cols), selector=ATTENTION_ONLY)
    change = ["x" if differs[i] or probe.alias_token(i) is None else ("=" if offset == 0 else "~")
              for i in range(rows * cols)]
    reuse = tuple(i for i, c in enumerate(change) if c != "x")
    changed_share = change.count("x") / len(change)
    return ImagePlan(key="1" * 64, kind=APPROXIMATE, tokens=rows * cols, grid=grid, alias="0" * 64, shift=shift,
                     change_map="".join(change), similarity=0.9, warmup_layers=WARMUP, reuse=reuse,
                     recompute_share=max(RHO, changed_share), selector=ATTENTION_ONLY)


def gateway_plan(a_image: Image.Image, b_image: Image.Image, grid: tuple[int, int],
                 settings: MatchSettings = MatchSettings()) -> ImagePlan | None:
    """The approximate plan the gateway, with A stored, makes for B (None: a miss): its pixel features, the coarse
    and fine stages (content moved by part of a token lined up again, gateway/matching/moved.py) and the guard, at
    ``settings`` (the defaults), the selector as ``moved`` has it."""
    extractor = PixelExtractor()
    a_features, b_features = extractor.extract(a_image, grid, CELL), extractor.extract(b_image, grid, CELL)
    matcher = Matcher(settings, scope="bench", features=None)
    matcher.add("0" * 64, "bench", a_features)
    moved = MovedImage.of_image(b_image, extractor, grid=grid, factor=CELL, settings=settings)
    lookup = matcher.lookup("bench", "1" * 64, b_features, moved)
    if not lookup.matches:
        return None
    return approximate_plan(lookup.matches[0], b_features.entropy, key="1" * 64, grid=grid, prefix_digest="",
                            settings=settings, selector=ATTENTION_ONLY, layers=None)


def evaluate(model: ReferenceModel, pairs, offsets, directions=DIRECTIONS, progress: bool = True,
             split_pan: int = SPLIT_PAN) -> dict:
    names = answer_ids(model.processor.tokenizer)
    tallies: dict[tuple[str, int, str], dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))
    planned: dict[tuple[str, int], int] = defaultdict(int)
    started = time.perf_counter()
    for done, pair in enumerate(pairs, 1):
        for direction in directions:
            a_image = cached_view(direction, pair.cached)
            a_prompt = model.prompt([a_image, field(pair.cached, pair.unchanged).text])
            a_encoder = model.encode(a_prompt)[0]
            entry = capture(prefill(model, a_prompt, [Fresh(a_encoder)]).state, a_prompt.images[0], a_encoder)
            grid = (a_image.height // CELL, a_image.width // CELL)  # every offset's: the band is whole cells
            for offset in offsets:
                b_image = moved_view(direction, offset, pair.asked, split_pan)
                a_moved = moved_view(direction, offset, pair.cached, split_pan)
                planned_b = gateway_plan(a_image, b_image, grid)
                planned[(direction, offset)] += planned_b is not None
                for kind, question, stale in pair.questions():
                    prompt = model.prompt([b_image, question.text])
                    _, h, w = prompt.images[0].grid
                    encoder = model.encode(prompt)[0]
                    right = question.answer
                    for name, plan in (("full", None),
                                       ("moved", moved_plan(a_moved, b_image, (h, w), direction,
                                                            max(offset, split_pan) if direction == SPLIT else offset)),
                                       ("gateway", planned_b)):
                        if name == "gateway" and plan is None:
                            continue
                        image: Fresh | Approximate = Fresh(encoder) if plan is None else \
                            execute(model, prompt, plan, encoder, entry)[0]
                        answer = names.get(int(prefill(model, prompt, [image]).logits.argmax()), "?")
                        tallies[(direction, offset, name)][kind].add(answer, right, stale)
                        if name == "full" and planned_b is not None:  # the bar for the gateway's plans: the same pairs
                            tallies[(direction, offset, "full, planned pairs")][kind].add(answer, right, stale)
        if progress:
            print(f"  {done}/{len(pairs)} pairs, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {"tallies": tallies, "planned": {key: n / len(pairs) for key, n in planned.items()},
            "seconds": time.perf_counter() - started}


def rate(tally: Tally, what: str = "right") -> float:
    return 100 * getattr(tally, what) / tally.asked if tally.asked else float("nan")


def table(result: dict, offsets, directions=DIRECTIONS) -> tuple[str, dict[str, list[int]]]:
    """The table, and per direction the offsets within 2 points of a full prefill on both kinds of question (where
    the full prefill reads B: module docstring)."""
    tallies = result["tallies"]
    lines = ["| motion | offset (px) | full: changed / unchanged right | moved: changed / unchanged right | "
             "moved: changed stale | within 2 points | gateway plans | gateway's plans: changed / unchanged right, "
             "changed stale (full prefill of the same pairs) |", "|---|---|---|---|---|---|---|---|"]
    safe: dict[str, list[int]] = {direction: [] for direction in directions}
    for direction in directions:
        for offset in offsets:
            full, plan = tallies[(direction, offset, "full")], tallies[(direction, offset, "moved")]
            ours, bar = tallies.get((direction, offset, "gateway"), {}), tallies.get((direction, offset,
                                                                                      "full, planned pairs"), {})
            ours_text = f"{rate(ours[CHANGED]):.1f} / {rate(ours[UNCHANGED]):.1f}, " \
                f"{rate(ours[CHANGED], 'stale'):.1f} (full: {rate(bar[CHANGED]):.1f} / {rate(bar[UNCHANGED]):.1f})" \
                if ours else "-"
            readable = all(rate(full[kind]) >= READABLE for kind in (CHANGED, UNCHANGED))
            holds = readable and all(rate(plan[kind]) >= rate(full[kind]) - 2 for kind in (CHANGED, UNCHANGED))
            if holds:
                safe[direction].append(offset)
            verdict = "yes" if holds else "no" if readable else "no verdict: the reader cannot read B"
            lines.append(f"| {direction} | {offset} | {rate(full[CHANGED]):.1f} / {rate(full[UNCHANGED]):.1f} | "
                         f"{rate(plan[CHANGED]):.1f} / {rate(plan[UNCHANGED]):.1f} | "
                         f"{rate(plan[CHANGED], 'stale'):.1f} | {verdict} | "
                         f"{100 * result['planned'][(direction, offset)]:.1f}% | {ours_text} |")
    return "\n".join(lines), safe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--offsets", type=int, nargs="+", help=f"0 to {BAND * CELL} (a split's: 0 to {CELL // 2 - 1}; "
                                                                 f"default {OFFSETS}, a split's {SPLIT_OFFSETS})")
    parser.add_argument("--split", action="store_true",
                        help=f"two motions in one image (the top half panned by {SPLIT_PAN} px, the bottom half "
                             "scrolled by the offset) instead of one scroll or pan")
    parser.add_argument("--split-pan", type=int, default=SPLIT_PAN, metavar="PX",
                        help=f"how far a split's top half is panned (default {SPLIT_PAN}; past the horizontal bound "
                             "the gateway recomputes that half where it changed, and reuses the rest)")
    parser.add_argument("--trained", default=MOVED_ORACLE,
                        help="the committed weights of the oracle's recipe to judge with (qwen2_5_vl-oracle: the one "
                             "trained on the token grid only)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    directions = (SPLIT,) if args.split else DIRECTIONS
    offsets = args.offsets or list(SPLIT_OFFSETS if args.split else OFFSETS)
    top = CELL // 2 - 1 if args.split else BAND * CELL
    if bad := [offset for offset in offsets if not 0 <= offset <= top]:
        parser.error(f"offsets {bad}: 0 to {top} px")
    if not 0 <= args.split_pan <= CELL // 2:
        parser.error(f"--split-pan {args.split_pan}: 0 to {CELL // 2} px (the split keeps every token in place)")
    model = ReferenceModel.load(build_recipe(dataclasses.replace(get_recipe(QWEN2_5_VL, ORACLE),
                                                                 trained=args.trained)))
    pairs = make_pairs(args.pairs, seed=args.seed, max_side=MAX_SIDE - BAND)
    result = evaluate(model, pairs, offsets, directions, split_pan=args.split_pan)
    text, safe = table(result, offsets, directions)
    print(text)
    for direction, holding in safe.items():
        mostly = [o for o in offsets if result["planned"][(direction, o)] >= 0.5]
        print(f"{direction}: within 2 points of a full prefill at {holding or 'no offset'}; the gateway plans most "
              f"pairs at {mostly or 'no offset'}")
    print(f"({len(pairs)} pairs, two questions each, {result['seconds']:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "tallies": {f"{d} {o} {n}": {k: t.as_dict() for k, t in kinds.items()}
                        for (d, o, n), kinds in result["tallies"].items()},
            "planned": {f"{d} {o}": share for (d, o), share in result["planned"].items()},
            "safe": safe, "seconds": result["seconds"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
