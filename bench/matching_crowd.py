"""bench/matching.py's ``crowd`` section: content moved by part of a token, looked up among look-alikes.

Every distinct A of the labelled set is indexed in one namespace; each is then moved by each of MOVES (dy, dx)
pixels (scrolled: its content up; panned: left; the edge it uncovers repeated, as gateway/matching/moved.py moves
content back) and looked up and planned as the gateway plans a new image (the coarse stage, the fine stage in place
and moved back by part of a token, the guard). Per move and family: how often the plan's alias is the image's own
A, another A (a near-duplicate in the set: one page edited in several pairs), or none; and the lookup's time. Then
the unrelated pairs' B (images the set does not index) the same way: a plan for one would be a wrong answer's
start, unless B is the same picture as the A it was planned on. What the coarse stage's descriptors were chosen by
(gateway/matching/features.py, LAYOUT_STRUCTURE).

    .venv/bin/python bench/matching.py --sections crowd
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import numpy as np
from PIL import Image

from bench.matching import CELL, extract, key, moved_of, planned
from gateway.config import MatchSettings
from gateway.matching.features import Extractor
from gateway.matching.matcher import Matcher
from gateway.matching.moved import moved_back
from offline.near_duplicates import Pair

# (dy, dx) pixels, each within the default bounds planned (MatchSettings.max_subtoken_px_y and _x): scrolls by 1, 2,
# 7 and 13 px (the most under half a token) and a token and a pixel; pans by 1, 2 and 5 px and a token and a pixel.
MOVES = ((1, 0), (2, 0), (7, 0), (13, 0), (29, 0), (0, 1), (0, 2), (0, 5), (0, 29))


def move_name(move: tuple[int, int]) -> str:
    return f"scroll {move[0]} px" if move[1] == 0 else f"pan {move[1]} px"


def moved_crowd(extractor: Extractor, settings: MatchSettings, pairs: list[Pair]) -> dict[str, Any]:
    images: dict[bytes, tuple[str, Image.Image]] = {}
    for pair in pairs:
        if pair.a.width % CELL == 0 and pair.a.height % CELL == 0:
            images.setdefault(pair.a.tobytes(), (pair.family, pair.a))
    matcher = Matcher(settings, scope="bench", features=None)
    for i, (_, image) in enumerate(images.values()):
        matcher.add(key(("a", i)), "ns", extract(extractor, image))
    rows: dict[tuple[tuple[int, int], str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for i, (family, image) in enumerate(images.values()):
        for move in MOVES:
            b = Image.fromarray(moved_back(np.asarray(image), move))
            features, moved = extract(extractor, b), moved_of(extractor, settings, b)
            started = time.perf_counter()
            _, plan, _ = planned(matcher, settings, key(("b", i, move)), features, moved)
            times[move].append(time.perf_counter() - started)
            row = rows[(move, family)]
            row["moves"] += 1
            if plan is not None:
                row["own" if plan.alias == key(("a", i)) else "another"] += 1
    # What a miss costs among them: the unrelated pairs' B (an image the set does not index) looked up. The set
    # draws pictures from a few sources, so such a B may be another pair's A, or the same page moved: a plan on an
    # image it is the same picture as (similarity 0.99 or more, as crowd_quality counts it) is not a false match.
    matched, same_picture, miss_times = 0, 0, list[float]()
    for pair in pairs:
        if pair.near_duplicate is False and pair.b.tobytes() not in images:
            features, moved = extract(extractor, pair.b), moved_of(extractor, settings, pair.b)
            started = time.perf_counter()
            match, plan, _ = planned(matcher, settings, key(("miss", len(miss_times))), features, moved)
            miss_times.append(time.perf_counter() - started)
            if plan is not None and match is not None and match.alignment.similarity >= 0.99:
                same_picture += 1
            else:
                matched += plan is not None
    return {"indexed": len(images),
            "misses": {"looked_up": len(miss_times), "matched": matched, "same_picture": same_picture,
                       "ms_median": 1e3 * statistics.median(miss_times),
                       "ms_p90": 1e3 * float(np.percentile(miss_times, 90))},
            "moves": {move_name(move): {"families": {family: dict(row) for (m, family), row in sorted(rows.items())
                                                     if m == move},
                             "ms_median": 1e3 * statistics.median(times[move]),
                             "ms_p90": 1e3 * float(np.percentile(times[move], 90))} for move in MOVES}}


def print_moved_crowd(result: dict[str, Any]) -> None:
    print(f"  {result['indexed']} images indexed; each moved (scrolls and pans) and looked up among them")
    for move, part in result["moves"].items():
        families = part["families"]
        total = {k: sum(row.get(k, 0) for row in families.values()) for k in ("moves", "own", "another")}
        print(f"  {move:13s}: planned on its own image {total['own']} / {total['moves']} "
              f"({100 * total['own'] / max(1, total['moves']):.1f}%), another {total['another']}; lookup "
              f"{part['ms_median']:.1f} ms median, {part['ms_p90']:.1f} p90")
        print("        " + ", ".join(f"{family} {row.get('own', 0)}/{row['moves']}"
                                     for family, row in families.items()))
    misses = result["misses"]
    print(f"  unrelated images looked up among them: {misses['looked_up']}, planned {misses['matched']} (and "
          f"{misses['same_picture']} on an indexed image they are the same picture as); lookup "
          f"{misses['ms_median']:.1f} ms median, {misses['ms_p90']:.1f} p90")
