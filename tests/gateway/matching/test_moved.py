"""Content moved by part of a token (gateway/matching/moved.py): found from the two images' shades to the pixel,
lined up again, and matched only within MatchSettings.max_subtoken_px of the token grid; a scanned page scrolled
by a few pixels, windows of it at its own resolution (text as crisp as a screenshot's; the same page scaled up
is smooth enough that a 1 px scroll still matches in place)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from gateway.config import MatchSettings
from gateway.matching.align import SAME, SIMILAR
from gateway.matching.matcher import compare
from gateway.matching.moved import MovedImage, MovedImages, moved_back
from gateway.matching.plans import plan_against
from plan import FULL_PASS, PARTIAL_PASS
from tests.gateway.matching.pairs import CELL, EXTRACTOR, aligned, edited, encode_png, features
from tests.images_lib import load

ROWS, COLS = 5, 13
SETTINGS = MatchSettings()


def scrolled(offset: int) -> tuple[Image.Image, Image.Image]:
    """(A, B): a window of a scanned page, and the window ``offset`` px further down (its content moved up)."""
    page = load("page.png").convert("RGB")  # 384 x 191
    return (page.crop((0, 0, COLS * CELL, ROWS * CELL)),
            page.crop((0, offset, COLS * CELL, offset + ROWS * CELL)))


def moved_image(image: Image.Image, settings: MatchSettings = SETTINGS) -> MovedImage:
    return MovedImage.of_image(image, EXTRACTOR, grid=(ROWS, COLS), factor=CELL, settings=settings)


def test_moving_back_undoes_a_move_and_repeats_the_edge() -> None:
    pixels = np.arange(30).reshape(5, 6)
    moved = np.vstack([pixels[2:], pixels[-1:], pixels[-1:]])  # content up by 2, the last row repeated
    assert (moved_back(pixels, (2, 0)) == moved).all()
    assert (moved_back(pixels, (0, -1))[:, 1:] == pixels[:, :-1]).all()
    assert (moved_back(pixels, (0, -1))[:, 0] == pixels[:, 0]).all()


@pytest.mark.parametrize(("offset", "shift", "rest"), [(1, (0, 0), (-1, 0)), (2, (0, 0), (-2, 0)),
                                                        (26, (-1, 0), (2, 0)), (29, (-1, 0), (-1, 0))])
def test_a_scroll_up_to_2_px_off_the_grid_is_found_lined_up_and_matched(offset, shift, rest) -> None:
    a, b = scrolled(offset)
    fa, fb = features(a), features(b)
    in_place = compare(fb, fa, SETTINGS)
    assert in_place.similarity < SETTINGS.match_threshold  # every token's content moved within it
    move = moved_image(b).find(fb, fa)
    assert move is not None and (move.shift, move.offset) == (shift, rest)
    assert move.confidence >= SETTINGS.min_motion_confidence
    alignment = compare(fb, fa, SETTINGS, moved_image(b))
    assert alignment.similarity >= SETTINGS.match_threshold and alignment.shift == shift
    assert alignment.offset == rest and SAME not in alignment.changes  # moved content is never the same
    aligned_tokens = alignment.alias_index >= 0  # a scroll by a token or more brings a row in: changed
    assert (alignment.changes[aligned_tokens] == SIMILAR).mean() > 0.8
    plan = plan_against(fb, fa, alias="a" * 64, key="b" * 64, settings=SETTINGS, selector="attention_only",
                        layers=8, moved=moved_image(b))
    assert plan is not None and plan.shift == shift and plan.vision == FULL_PASS  # its own encoder output


@pytest.mark.parametrize("offset", [3, 5, 14, 24])
def test_a_scroll_further_off_the_grid_is_not_matched(offset) -> None:
    a, b = scrolled(offset)
    fa, fb = features(a), features(b)
    assert moved_image(b).find(fb, fa) is None
    alignment = compare(fb, fa, SETTINGS, moved_image(b))
    assert alignment.similarity < SETTINGS.match_threshold and alignment.offset == (0, 0)


def test_sub_token_moves_can_be_switched_off_and_leave_in_place_matches_alone() -> None:
    a, b = scrolled(1)
    fa, fb = features(a), features(b)
    off = MatchSettings(max_subtoken_px=0)
    assert moved_image(b, off).find(fb, fa) is None
    assert MovedImages(EXTRACTOR, CELL, max_px=0, min_confidence=0.15).of(encode_png(b), (ROWS, COLS)) is None
    assert compare(fb, fa, off, moved_image(b, off)).similarity < off.match_threshold
    # An edit in place matches as before, with the alias' encoder output where nothing changed.
    near = edited(a, (5 * CELL + 3, 2 * CELL + 3, 7 * CELL + 10, 2 * CELL + 24))
    never = MovedImage(lambda: pytest.fail("decoded for a match in place"), EXTRACTOR, grid=(ROWS, COLS),  # type: ignore
                       factor=CELL, max_px=2, min_confidence=0.15)
    plan = plan_against(features(near), fa, alias="a" * 64, key="b" * 64, settings=SETTINGS,
                        selector="attention_only", layers=8, moved=never)
    assert plan is not None and plan.vision == PARTIAL_PASS and plan.shift == (0, 0)


def test_an_unrelated_image_is_not_matched_by_moving_it() -> None:
    a = aligned("page.png", ROWS, COLS)
    for name in ("text.png", "camera.png", "coffee.png"):
        other = aligned(name, ROWS, COLS)
        alignment = compare(features(other), features(a), SETTINGS, moved_image(other))
        assert alignment.similarity < SETTINGS.match_threshold


def test_the_planner_decodes_the_image_it_forwards() -> None:
    a, b = scrolled(27)
    images = MovedImages(EXTRACTOR, CELL, max_px=2, min_confidence=0.15)
    moved = images.of(encode_png(b), (ROWS, COLS))
    assert moved is not None and (moved.pixels == np.asarray(b)).all()
    move = moved.find(features(b), features(a))
    assert move is not None and (move.shift, move.offset) == ((-1, 0), (1, 0))


def test_an_image_that_cannot_be_decoded_again_is_planned_as_without_a_move() -> None:
    a, b = scrolled(1)
    broken = MovedImages(EXTRACTOR, CELL, max_px=2, min_confidence=0.15).of(b"not an image", (ROWS, COLS))
    assert broken is not None and broken.find(features(b), features(a)) is None
    assert compare(features(b), features(a), SETTINGS, broken).offset == (0, 0)
