"""Motion at pixel level (gateway/matching/motion.py): phase correlation finds how far content moved, parts of a
token included, where token digests see nothing in place."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image

from gateway.matching.motion import Motion, find_motion, grey_of, regional_motions
from offline.near_duplicates.scans import scan_scrolls
from tests.gateway.matching.pairs import CELL
from tests.images_lib import load


def windows(name: str, size: tuple[int, int], moved: tuple[int, int]) -> tuple[Image.Image, Image.Image]:
    """Two windows of a photo (enlarged 2x), the second ``moved`` (down, right) pixels further on: its content
    moved by -moved."""
    photo = load(name)
    photo = photo.resize((photo.width * 2, photo.height * 2), Image.Resampling.LANCZOS)
    top, left = 40, 40
    a = photo.crop((left, top, left + size[1], top + size[0]))
    b = photo.crop((left + moved[1], top + moved[0], left + moved[1] + size[1], top + moved[0] + size[0]))
    return a, b


@pytest.mark.parametrize("moved", [(13, -5), (0, 8), (-24, 0), (41, 17)])
@pytest.mark.parametrize("reduce", [1, 2])
def test_a_pan_by_any_number_of_pixels_is_found_to_half_a_pixel(moved: tuple[int, int], reduce: int) -> None:
    a, b = windows("astronaut.png", (12 * CELL, 16 * CELL), moved)
    found = find_motion(grey_of(a, reduce), grey_of(b, reduce), reduce=reduce)
    assert found.dy == pytest.approx(-moved[0], abs=0.5) and found.dx == pytest.approx(-moved[1], abs=0.5)
    assert found.confidence > 0.3


def test_unrelated_pictures_have_no_confident_motion() -> None:
    a, _ = windows("astronaut.png", (12 * CELL, 16 * CELL), (0, 0))
    b, _ = windows("coffee.png", (12 * CELL, 16 * CELL), (0, 0))
    assert find_motion(grey_of(a), grey_of(b)).confidence < 0.1


def test_partial_scrolls_of_a_scanned_page_are_found_to_the_pixel() -> None:
    """The labelled set's scrolls by a number of pixels that is not a multiple of the token (13 px, 41 px...)."""
    pairs = scan_scrolls(random.Random(3), 4, False, False)
    assert pairs and all(pair.true_motion() is not None and pair.true_motion()[0] % CELL for pair in pairs)
    for pair in pairs:
        found = find_motion(grey_of(pair.a, 2), grey_of(pair.b, 2), reduce=2)
        assert (found.dy, found.dx) == (pytest.approx(pair.true_motion()[0], abs=0.5),  # type: ignore[index]
                                        pytest.approx(0, abs=0.5)), pair.name


def test_a_motion_splits_into_whole_tokens_and_a_remainder() -> None:
    assert Motion(41.0, -15.0, 1.0).in_tokens(28) == ((1, -1), (13.0, 13.0))
    assert Motion(-13.5, 0.0, 1.0).in_tokens(28) == ((0, 0), (-13.5, 0.0))


def test_blank_or_tiny_images_give_no_motion() -> None:
    blank = np.full((56, 56), 200, np.float32)
    assert find_motion(blank, blank) == Motion(0.0, 0.0, 0.0)
    assert find_motion(np.zeros((2, 9), np.float32), np.zeros((2, 9), np.float32)).confidence == 0.0


def test_each_region_of_a_frame_finds_its_own_motion() -> None:
    """A frame whose left half moved 6 px right and right half 9 px left (a subject and the camera): a motion per
    region, each within half a pixel, where the whole frame's motion can only be one of them."""
    photo = load("astronaut.png").resize((1024, 1024), Image.Resampling.LANCZOS)
    size, top, left = 12 * CELL, 200, 200
    a = photo.crop((left, top, left + size, top + size))
    half = size // 2
    b = Image.new("RGB", (size, size))
    b.paste(photo.crop((left - 6, top, left - 6 + half, top + size)), (0, 0))  # content moved 6 px right
    b.paste(photo.crop((left + half + 9, top, left + size + 9, top + size)), (half, 0))  # 9 px left
    parts = regional_motions(grey_of(a), grey_of(b), regions=(2, 2))
    assert [part.box for part in parts[:2]] == [(0, 0, half, half), (0, half, half, size)]
    for part in parts:
        expected = 6 if part.box[1] == 0 else -9
        assert (part.motion.dy, part.motion.dx) == (pytest.approx(0, abs=0.5), pytest.approx(expected, abs=0.5))
        assert part.motion.confidence > 0.3
    reduced = regional_motions(grey_of(a, 2), grey_of(b, 2), regions=(1, 2), reduce=2)
    assert [round(part.motion.dx) for part in reduced] == [6, -9] and reduced[1].box == (0, half, size, size)
    with pytest.raises(ValueError):
        regional_motions(grey_of(a), grey_of(b), regions=(0, 2))
