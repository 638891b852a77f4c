"""bench/matching.py's ``video`` section: the next frames of real clips, from a still camera and a moving one.

The labelled set holds 16 next frames, a handful of them from a moving camera. This takes up to FRAMES pairs of
consecutive frames from each clip Debian's opencv-doc ships (offline.near_duplicates.video.next_frames, cuts left
out), and looks each B up against its A alone, planned as the gateway plans it (bench/matching.py's ``planned``:
the fine stage in place and moved by part of a token, the guard). A pair's camera moved where the global motion
between the frames (motion.find_motion on their grey) is a pixel or more on either axis. Per clip and camera: how
many were planned approximate, on each half (every other pair, as the tune section splits the labelled set), and
why the rest were not: no alignment, in place or moved, reached the match threshold (``similarity``), or one did
and the guard refused it (``changed_share``).

    .venv/bin/python bench/matching.py --sections video
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from bench.matching import extract, key, moved_of, planned
from gateway.config import MatchSettings
from gateway.matching.features import Extractor
from gateway.matching.matcher import Matcher
from gateway.matching.motion import find_motion, grey_of
from offline.near_duplicates import Pair
from offline.near_duplicates.video import find_clips, next_frames

FRAMES = 80  # pairs of consecutive frames per clip, at most
MOVING_PX = 1.0  # a global motion this large on either axis: the camera moved


def video_next(extractor: Extractor, settings: MatchSettings, frames: int = FRAMES, seed: int = 1) -> dict[str, Any]:
    rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for clip in find_clips():
        tally(rows, clip.name, next_frames(clip, frames, random.Random(seed)), extractor, settings)
    return {name: dict(row) for name, row in sorted(rows.items())}


def tally(rows: dict[str, dict[str, int]], clip: str, pairs: list[Pair], extractor: Extractor,
          settings: MatchSettings) -> None:
    """Each pair of ``clip`` planned (B against A alone), counted in ``rows`` under "<clip> still|moving"."""
    for i, pair in enumerate(pairs):
        motion = find_motion(grey_of(pair.a), grey_of(pair.b))
        camera = "moving" if max(abs(motion.dy), abs(motion.dx)) >= MOVING_PX else "still"
        matcher = Matcher(settings, scope="bench", features=None)
        matcher.add(key(("a", i)), "ns", extract(extractor, pair.a))
        match, plan, _ = planned(matcher, settings, key(("b", i)), extract(extractor, pair.b),
                                 moved_of(extractor, settings, pair.b))
        row = rows[f"{clip} {camera}"]
        half = "tune" if i % 2 == 0 else "eval"
        row[f"{half}_pairs"] += 1
        row[f"{half}_matched"] += plan is not None
        if plan is None:
            row["similarity" if match is None else "changed_share"] += 1


def print_video_next(result: dict[str, Any]) -> None:
    if not result:
        print("  no clip installed (apt-get install opencv-doc ffmpeg)")
        return
    print(f"  {'clip and camera':22s} {'tune half':>14s} {'eval half':>14s}   refused: similarity, changed share")
    for name, row in result.items():
        print(f"  {name:22s} {_share(row, 'tune'):>14s} {_share(row, 'eval'):>14s}   {row.get('similarity', 0)}, "
              f"{row.get('changed_share', 0)}")


def _share(row: dict[str, int], half: str) -> str:
    matched, pairs = row.get(f"{half}_matched", 0), row.get(f"{half}_pairs", 0)
    return f"{matched}/{pairs} {100 * matched / pairs:3.0f}%" if pairs else "-"
