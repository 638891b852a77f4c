"""bench/matching.py's split of the labelled set for tuning, and which pairs a plan may be made for at all."""

from __future__ import annotations

from PIL import Image

from bench.matching import off_grid
from bench.matching_tune import halves, in_reach
from gateway.config import MatchSettings
from offline.near_duplicates import Pair

BLANK = Image.new("RGB", (56, 56))


def pair(name: str, family: str = "doc_scroll_partial", motion: tuple[int, int] | None = None,
         shift: tuple[int, int] | None = None) -> Pair:
    return Pair(name, family, BLANK, BLANK, True, None, shift, motion=motion)


def test_each_half_holds_every_other_pair_of_each_family() -> None:
    pairs = [pair(f"{family}/{i}", family) for i in range(7) for family in ("doc_edit", "photo_jpeg", "unrelated")]
    split = halves(pairs)
    assert split == halves(pairs)  # the same split every run
    for family in ("doc_edit", "photo_jpeg", "unrelated"):
        mine = [half for p, half in zip(pairs, split, strict=True) if p.family == family]
        assert mine == ["tune", "eval"] * 3 + ["tune"]


def test_only_content_moved_by_whole_tokens_or_within_the_bounds_off_the_grid_is_in_reach() -> None:
    settings = MatchSettings()  # 13 px vertically (every remainder but half a token), 5 horizontally
    assert off_grid(pair("a", motion=(-83, 0))) == (1, 0) and in_reach(pair("a", motion=(-83, 0)), settings)
    assert off_grid(pair("b", motion=(26, 0))) == (-2, 0) and in_reach(pair("b", motion=(26, 0)), settings)
    assert in_reach(pair("c", motion=(7, -2)), settings) and in_reach(pair("c", motion=(-13, 5)), settings)
    assert not in_reach(pair("c", motion=(-14, 0)), settings)  # half a token: a tie
    assert not in_reach(pair("c", motion=(7, -7)), settings)  # panned 7 px off the grid: reuse does not hold
    assert in_reach(pair("d", "doc_scroll_whole", shift=(-2, 0)), settings)  # 56 px: whole tokens
    assert in_reach(pair("e", "doc_edit"), settings)  # the pair does not say how it moved
    assert not in_reach(pair("a", motion=(-83, 0)), MatchSettings(max_subtoken_px_y=0))
    assert in_reach(pair("a", motion=(0, -83)), MatchSettings(max_subtoken_px_y=0))


def test_the_crowd_section_finds_each_image_moved_by_a_pixel_or_two_among_the_others() -> None:
    from bench.matching_crowd import MOVES, move_name, moved_crowd
    from gateway.matching.pixel import PixelExtractor
    from tests.gateway.matching.pairs import aligned
    from tests.images_lib import load

    page = load("page.png").convert("RGB").crop((0, 0, 13 * 28, 5 * 28))  # text as crisp as a screenshot's
    photo, other, unrelated = aligned("astronaut.png", 8, 8), aligned("coffee.png", 8, 8), aligned("camera.png", 8, 8)
    pairs = [Pair("page", "doc_edit", page, page, True, None, None),
             Pair("photo", "photo_jpeg", photo, photo, True, None, None),
             Pair("other", "photo_jpeg", other, other, True, None, None),
             Pair("unrelated", "unrelated", photo, unrelated, False, None, None)]
    result = moved_crowd(PixelExtractor(), MatchSettings(), pairs)
    assert result["indexed"] == 3  # the astronaut once, though two pairs hold it
    for move in MOVES:
        families = result["moves"][move_name(move)]["families"]
        assert families["doc_edit"] == {"moves": 1, "own": 1}, move
        assert families["photo_jpeg"] == {"moves": 2, "own": 2}, move
    assert result["misses"]["looked_up"] == 1 and result["misses"]["matched"] == result["misses"]["same_picture"] == 0


def test_the_video_section_counts_next_frames_by_camera_and_half_and_says_why_the_rest_were_refused() -> None:
    from collections import defaultdict

    import numpy as np
    from PIL import Image

    from bench.matching_video import tally
    from gateway.matching.moved import moved_back
    from gateway.matching.pixel import PixelExtractor
    from tests.gateway.matching.pairs import aligned

    frame = aligned("astronaut.png", 8, 8)
    panned = Image.fromarray(moved_back(np.asarray(frame), (0, 3)))  # the camera moved: content 3 px left
    unrelated = aligned("camera.png", 8, 8)
    pairs = [Pair("still", "video_next", frame, frame, True, None, None),
             Pair("moving", "video_next", frame, panned, True, None, None),
             Pair("cut", "video_next", frame, unrelated, True, None, None)]
    rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    tally(rows, "clip", pairs, PixelExtractor(), MatchSettings())
    assert dict(rows["clip still"]) == {"tune_pairs": 1, "tune_matched": 1}  # the same frame: every other pair tunes
    moving = dict(rows["clip moving"])
    assert moving["eval_pairs"] == moving["eval_matched"] == 1  # the pan, lined up again
    # The cut (its junk motion may say either) is the one refused: no alignment reached the match threshold.
    assert sum(row.get("similarity", 0) for row in rows.values()) == 1
    assert sum(row.get("tune_pairs", 0) - row.get("tune_matched", 0) for row in rows.values()) == 1
    assert not any(row.get("changed_share") for row in rows.values())
