"""Is reusing K/V safe for content moved by part of a token? The reading model that depends on late-layer image KV
(the oracle) decides, through the reference (offline.reference.approximate: the rule the workers run).

    .venv/bin/python bench/moved_quality.py [--pairs 24] [--offsets 0 1 2 ...] [--json FILE]

For each offset k (pixels the content moved: a page scrolled, its content up by k; a frame panned, its content
left by k; whole tokens plus a remainder too) and each pair of offline.reader_eval (A cached; B = A with one field
given another value), B's panel is drawn moved by k pixels (the strip moved into view is the panel's background)
and asked about its changed field and an unchanged one:

    full     B from scratch: the bar (the reader itself reads a moved panel less well than an aligned one)
    moved    B planned as the gateway would plan a known motion: each B token lines up with the A token its pixels
             mostly come from (the motion rounded to whole tokens: the plan's shift), whose K/V it reuses with the
             keys moved to B's positions; the tokens whose pixels differ from A's content moved the same way (the
             revalued field; tokens with no A token) are changed and recomputed, with the share the selector adds
             (attention_only, rho 0.3 widened to the changed share, W 3, B's own encoder output)

A changed-field answer with A's value is "stale": the moved K/V were read as they are. An offset is safe to plan
where ``moved`` is within 2 points of ``full`` on both kinds of question, and only where ``full`` itself reads B
(at least READABLE right on both): where the reader cannot read a moved panel at all, agreeing with it says nothing,
and the offset gets no verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bundled import QWEN2_5_VL, build_model  # noqa: E402
from bundled.reader.panels import CELL  # noqa: E402
from bundled.reader.questions import field  # noqa: E402
from offline.reader_eval import CHANGED, UNCHANGED, Tally, answer_ids, make_pairs  # noqa: E402
from offline.reference import Approximate, Fresh, ReferenceModel, capture, prefill  # noqa: E402
from offline.reference.approximate import execute  # noqa: E402
from plan import APPROXIMATE, ATTENTION_ONLY, ImagePlan  # noqa: E402

OFFSETS = (0, 1, 2, 3, 5, 7, 10, 14, 18, 21, 24, 26, 27, 33, 42, 59)
DIRECTIONS = ("scroll", "pan")
CHANGED_LEVEL = 24  # a token is changed where a pixel differs from A's moved content by more (as the labelled set)
RHO, WARMUP = 0.3, 3
READABLE = 90.0  # % of a full prefill's answers right, on both kinds, for an offset to get a verdict


def moved(image: Image.Image, direction: str, offset: int, background: tuple[int, int, int]) -> Image.Image:
    """The image's content moved up (scroll) or left (pan) by ``offset`` pixels, the strip moved in filled."""
    out = Image.new("RGB", image.size, background)
    out.paste(image, (0, -offset) if direction == "scroll" else (-offset, 0))
    return out


def moved_plan(a_moved: Image.Image, b_image: Image.Image, grid: tuple[int, int], direction: str,
               offset: int) -> ImagePlan:
    """The approximate plan of B against A under the known motion (see the module docstring)."""
    rows, cols = grid
    whole = round(offset / CELL)
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


def evaluate(model: ReferenceModel, pairs, offsets, progress: bool = True) -> dict:
    names = answer_ids(model.processor.tokenizer)
    tallies: dict[tuple[str, int, str], dict[str, Tally]] = defaultdict(lambda: defaultdict(Tally))
    started = time.perf_counter()
    for done, pair in enumerate(pairs, 1):
        a_image = pair.cached.render()
        a_prompt = model.prompt([a_image, field(pair.cached, pair.unchanged).text])
        a_encoder = model.encode(a_prompt)[0]
        entry = capture(prefill(model, a_prompt, [Fresh(a_encoder)]).state, a_prompt.images[0], a_encoder)
        for direction in DIRECTIONS:
            for offset in offsets:
                if direction == "pan" and offset == 0:
                    continue  # the same pair as the scroll's
                b_image = moved(pair.asked.render(), direction, offset, pair.asked.background)
                a_moved = moved(a_image, direction, offset, pair.cached.background)
                for kind, key in pair.questions():
                    prompt = model.prompt([b_image, field(pair.asked, key).text])
                    _, h, w = prompt.images[0].grid
                    encoder = model.encode(prompt)[0]
                    right, stale = pair.asked.value(key), (pair.cached.value(key) if kind == CHANGED else None)
                    for name, plan in (("full", None),
                                       ("moved", moved_plan(a_moved, b_image, (h, w), direction, offset))):
                        image: Fresh | Approximate = Fresh(encoder) if plan is None else \
                            execute(model, prompt, plan, encoder, entry)[0]
                        answer = names.get(int(prefill(model, prompt, [image]).logits.argmax()), "?")
                        tallies[(direction, offset, name)][kind].add(answer, right, stale)
        if progress:
            print(f"  {done}/{len(pairs)} pairs, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {"tallies": tallies, "seconds": time.perf_counter() - started}


def rate(tally: Tally, what: str = "right") -> float:
    return 100 * getattr(tally, what) / tally.asked if tally.asked else float("nan")


def table(result: dict, offsets) -> tuple[str, dict[str, list[int]]]:
    """The table, and per direction the offsets within 2 points of a full prefill on both kinds of question (where
    the full prefill reads B: module docstring)."""
    tallies = result["tallies"]
    lines = ["| motion | offset (px) | full: changed / unchanged right | moved: changed / unchanged right | "
             "moved: changed stale | within 2 points |", "|---|---|---|---|---|---|"]
    safe: dict[str, list[int]] = {direction: [] for direction in DIRECTIONS}
    for direction in DIRECTIONS:
        for offset in offsets:
            full, plan = tallies.get((direction, offset, "full")), tallies.get((direction, offset, "moved"))
            if not full or not plan:
                continue  # a pan by 0 is the scroll by 0
            readable = all(rate(full[kind]) >= READABLE for kind in (CHANGED, UNCHANGED))
            holds = readable and all(rate(plan[kind]) >= rate(full[kind]) - 2 for kind in (CHANGED, UNCHANGED))
            if holds:
                safe[direction].append(offset)
            verdict = "yes" if holds else "no" if readable else "no verdict: the reader cannot read B"
            lines.append(f"| {direction} | {offset} | {rate(full[CHANGED]):.1f} / {rate(full[UNCHANGED]):.1f} | "
                         f"{rate(plan[CHANGED]):.1f} / {rate(plan[UNCHANGED]):.1f} | "
                         f"{rate(plan[CHANGED], 'stale'):.1f} | {verdict} |")
    return "\n".join(lines), safe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--offsets", type=int, nargs="+", default=list(OFFSETS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    model = ReferenceModel.load(build_model(QWEN2_5_VL, "oracle"))
    pairs = make_pairs(args.pairs, seed=args.seed)
    result = evaluate(model, pairs, args.offsets)
    text, safe = table(result, args.offsets)
    print(text)
    for direction, offsets in safe.items():
        print(f"{direction}: within 2 points of a full prefill at {offsets or 'no offset'}")
    print(f"({len(pairs)} pairs, two questions each, {result['seconds']:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "tallies": {f"{d} {o} {n}": {k: t.as_dict() for k, t in kinds.items()}
                        for (d, o, n), kinds in result["tallies"].items()},
            "safe": safe, "seconds": result["seconds"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
