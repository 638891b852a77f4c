"""Content moved by part of a token (gateway/matching/moved.py): found from the two images' shades to the pixel,
lined up again, and matched only within MatchSettings.max_subtoken_px_y and _x of the token grid; a scanned page
scrolled or panned by a few pixels, windows of it at its own resolution (text as crisp as a screenshot's; the same
page scaled up is smooth enough that a 1 px scroll still matches in place)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from gateway.config import MatchSettings
from gateway.matching.align import CHANGED, SAME, SIMILAR
from gateway.matching.features import SHADE_SIDE, cell_means, grey
from gateway.matching.matcher import Matcher, compare, in_place
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


def panned(offset: int) -> tuple[Image.Image, Image.Image]:
    """(A, B): a window of a scanned page, and the window ``offset`` px further right (its content moved left)."""
    page = load("page.png").convert("RGB")  # 384 x 191
    return (page.crop((0, 0, COLS * CELL, ROWS * CELL)),
            page.crop((offset, 0, offset + COLS * CELL, ROWS * CELL)))


def moved_image(image: Image.Image, settings: MatchSettings = SETTINGS) -> MovedImage:
    return MovedImage.of_image(image, EXTRACTOR, grid=(ROWS, COLS), factor=CELL, settings=settings)


def test_the_shades_of_a_moved_image_are_those_of_its_moved_copy() -> None:
    """The shade search's sums over shifted windows equal the cell means of the image moved back, edges and all."""
    _, b = scrolled(29)
    image = moved_image(b)
    levels = grey(image.pixels.astype(np.float32)) * 255.0
    for offset in ((0, 0), (-1, 0), (3, -2), (-15, 15), (14, 0)):
        copy = cell_means(moved_back(levels, offset)[:, :, None], ROWS * SHADE_SIDE, COLS * SHADE_SIDE)[:, :, 0]
        assert np.abs(image._shades_moved_back(offset) - copy).max() < 1e-3  # noqa: SLF001


def test_moving_back_undoes_a_move_and_repeats_the_edge() -> None:
    pixels = np.arange(30).reshape(5, 6)
    moved = np.vstack([pixels[2:], pixels[-1:], pixels[-1:]])  # content up by 2, the last row repeated
    assert (moved_back(pixels, (2, 0)) == moved).all()
    assert (moved_back(pixels, (0, -1))[:, 1:] == pixels[:, :-1]).all()
    assert (moved_back(pixels, (0, -1))[:, 0] == pixels[:, 0]).all()


@pytest.mark.parametrize(("move", "offset", "shift", "rest"), [
    (scrolled, 1, (0, 0), (-1, 0)), (scrolled, 2, (0, 0), (-2, 0)), (scrolled, 7, (0, 0), (-7, 0)),
    (scrolled, 13, (0, 0), (-13, 0)), (scrolled, 15, (-1, 0), (13, 0)),
    (scrolled, 24, (-1, 0), (4, 0)), (scrolled, 26, (-1, 0), (2, 0)), (scrolled, 29, (-1, 0), (-1, 0)),
    (panned, 2, (0, 0), (0, -2)), (panned, 5, (0, 0), (0, -5))])
def test_a_scroll_by_any_part_of_a_token_but_half_or_a_pan_up_to_5_px_is_found_lined_up_and_matched(
        move, offset, shift, rest) -> None:
    a, b = move(offset)
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


@pytest.mark.parametrize(("move", "offset"), [(panned, 7), (panned, 10), (panned, 14), (scrolled, 14)])
def test_a_pan_further_off_the_grid_or_a_move_by_half_a_token_is_not_matched(move, offset) -> None:
    """At half a token (14 px) which cached token a token's content came from is a tie: never planned."""
    a, b = move(offset)
    fa, fb = features(a), features(b)
    assert moved_image(b).find(fb, fa) is None
    alignment = compare(fb, fa, SETTINGS, moved_image(b))
    assert alignment.similarity < SETTINGS.match_threshold and alignment.offset == (0, 0)


def test_sub_token_moves_can_be_switched_off_and_leave_in_place_matches_alone() -> None:
    a, b = scrolled(1)
    fa, fb = features(a), features(b)
    off = MatchSettings(max_subtoken_px_y=0, max_subtoken_px_x=0)
    assert moved_image(b, off).find(fb, fa) is None
    assert MovedImages(EXTRACTOR, CELL, off).of(lambda: encode_png(b), (ROWS, COLS)) is None
    # Either axis off alone: a scroll is not planned without the vertical bound, a pan still is.
    assert moved_image(b, MatchSettings(max_subtoken_px_y=0)).find(fb, fa) is None
    pa, pb = panned(2)
    assert moved_image(pb, MatchSettings(max_subtoken_px_y=0)).find(features(pb), features(pa)) is not None
    assert compare(fb, fa, off, moved_image(b, off)).similarity < off.match_threshold
    # An edit in place matches as before, with the alias' encoder output where nothing changed.
    near = edited(a, (5 * CELL + 3, 2 * CELL + 3, 7 * CELL + 10, 2 * CELL + 24))
    never = MovedImage(lambda: pytest.fail("decoded for a match in place"), EXTRACTOR, grid=(ROWS, COLS),  # type: ignore
                       factor=CELL, settings=SETTINGS)
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
    images = MovedImages(EXTRACTOR, CELL, SETTINGS)
    moved = images.of(lambda: encode_png(b), (ROWS, COLS))
    assert moved is not None and (moved.pixels == np.asarray(b)).all()
    move = moved.find(features(b), features(a))
    assert move is not None and (move.shift, move.offset) == ((-1, 0), (1, 0))


def test_an_image_that_cannot_be_decoded_again_is_planned_as_without_a_move() -> None:
    a, b = scrolled(1)
    broken = MovedImages(EXTRACTOR, CELL, SETTINGS).of(lambda: b"not an image", (ROWS, COLS))
    assert broken is not None and broken.find(features(b), features(a)) is None
    assert compare(features(b), features(a), SETTINGS, broken).offset == (0, 0)


def test_a_photo_moved_by_a_pixel_is_planned_moved_though_it_matches_in_place_with_most_tokens_changed() -> None:
    """A smooth photo moved by 1 px still scores 0.96 in place, with 81% of its tokens changed: the guard would plan
    a miss. The lookup then looks for the move, and the moved match (nothing changed) comes first."""
    a = aligned("astronaut.png", 8, 8)
    b = Image.fromarray(moved_back(np.asarray(a), (1, 0)))
    matcher = Matcher(SETTINGS, scope="test", features=None)
    matcher.add("a" * 64, "ns", features(a))
    moved = MovedImage.of_image(b, EXTRACTOR, grid=(8, 8), factor=CELL, settings=SETTINGS)
    found = matcher.lookup("ns", "b" * 64, features(b), moved)
    assert [m.alignment.offset for m in found.matches] == [(-1, 0), (0, 0)]
    assert found.matches[0].alignment.changed_share == 0.0 and found.matches[1].alignment.changed_share > 0.35
    assert [matcher.within_guard(m) for m in found.matches] == [True, False]
    # Without the move, the in-place match is all there is (and the guard refuses it).
    alone = matcher.lookup("ns", "b" * 64, features(b))
    assert [m.alignment.offset for m in alone.matches] == [(0, 0)] and not matcher.within_guard(alone.matches[0])


def test_moves_are_not_looked_for_when_a_candidate_matches_in_place_within_the_guard() -> None:
    a = aligned("page.png", ROWS, COLS)
    matcher = Matcher(SETTINGS, scope="test", features=None)
    matcher.add("a" * 64, "ns", features(a))
    near = edited(a, (5 * CELL + 3, 2 * CELL + 3, 7 * CELL + 10, 2 * CELL + 24))
    never = MovedImage(lambda: pytest.fail("decoded for a match in place"), EXTRACTOR, grid=(ROWS, COLS),  # type: ignore
                       factor=CELL, settings=SETTINGS)
    found = matcher.lookup("ns", "b" * 64, features(near), never)
    assert len(found.matches) == 1 and found.matches[0].alignment.offset == (0, 0)


def test_a_look_alike_of_one_layout_is_refused_from_its_shades_before_any_extraction() -> None:
    """Two of the reader's panels of one layout with other values, one scrolled by 1 px: the shades line up at a
    move (the labels and boxes do) but leave most tokens changed, which the guard would not plan; found without the
    guard's bound, and refused with it before the new image's features are taken again."""
    from bundled.reader.panels import Placement
    from offline.reader_eval import make_pairs

    pairs = make_pairs(60, seed=17, max_side=6)
    still, moved = Placement(top=2 * 28, pad=(2, 0)), Placement(top=2 * 28 - 1, pad=(2, 0))
    a, b = still.render(pairs[2].cached), moved.render(pairs[41].asked)
    grid = still.grid(pairs[2].cached)
    assert grid == still.grid(pairs[41].asked)
    fa, fb = (EXTRACTOR.extract(image, grid, CELL) for image in (a, b))

    class Counting:
        name, dim, calls = EXTRACTOR.name, EXTRACTOR.dim, 0

        def extract(self, image, grid, factor):  # type: ignore[no-untyped-def]
            self.calls += 1
            return EXTRACTOR.extract(image, grid, factor)

    unbounded = MovedImage.of_image(b, EXTRACTOR, grid=grid, factor=CELL,
                                    settings=MatchSettings(max_changed_share=1.0))
    assert unbounded.find(fb, fa) is not None
    counting = Counting()
    image = MovedImage.of_image(b, counting, grid=grid, factor=CELL, settings=SETTINGS)  # type: ignore[arg-type]
    assert image.find(fb, fa) is None
    assert compare(fb, fa, SETTINGS, image).similarity < SETTINGS.match_threshold and counting.calls == 0


def banded(image: Image.Image, moves: list[tuple[int, int]]) -> Image.Image:
    """``image`` cut into len(moves) bands of rows, band i's content moved by moves[i] (dy, dx) pixels."""
    pixels = np.asarray(image)
    out, height = pixels.copy(), pixels.shape[0]
    for i, (dy, dx) in enumerate(moves):
        band = slice(i * height // len(moves), (i + 1) * height // len(moves))
        out[band] = moved_back(pixels, (-dy, -dx))[band]
    return Image.fromarray(out)


def test_a_frame_whose_halves_moved_apart_is_lined_up_region_by_region() -> None:
    """One motion lines up one half and leaves the other's tokens changed (past the guard); a motion per region
    (moved.REGIONS) lines up both, each region's content moved back by its own offset, every token kept where it is."""
    a = aligned("astronaut.png", 8, 8)
    b = banded(a, [(-3, 0), (0, 4)])
    fa, fb = features(a), features(b)
    moved = MovedImage.of_image(b, EXTRACTOR, grid=(8, 8), factor=CELL, settings=SETTINGS)
    regions = moved.find_regions(fb, fa)
    assert regions is not None and len(regions.offsets) == 16
    assert set(regions.offsets[:8]) == {(-3, 0)} and set(regions.offsets[8:]) == {(0, 4)}
    whole = moved.find(fb, fa)
    if whole is not None:  # one motion alone: not within the guard
        once = compare(features(Image.fromarray(moved_back(np.asarray(b), whole.offset))), fa, SETTINGS)
        assert once.changed_share > SETTINGS.max_changed_share
    alignment = compare(fb, fa, SETTINGS, moved)
    assert alignment.similarity >= SETTINGS.match_threshold and alignment.changed_share <= SETTINGS.max_changed_share
    assert alignment.shift == (0, 0) and alignment.offset in ((-3, 0), (0, 4))
    plan = plan_against(fb, fa, alias="a" * 64, key="b" * 64, settings=SETTINGS, selector="attention_only",
                        layers=8, moved=moved)
    assert plan is not None and plan.shift == (0, 0) and plan.vision == FULL_PASS
    # A region panned further than the horizontal bound stays where it is: its tokens changed, past the guard here.
    far = banded(a, [(-3, 0), (0, 9)])
    assert compare(features(far), fa, SETTINGS, moved_image_of(far)).changed_share > SETTINGS.max_changed_share


def test_unrelated_images_are_refused_region_by_region_from_the_shades_without_a_decode() -> None:
    """The regions' motions come from the shades; where the regions left in place change more tokens than the guard
    plans, the new image is not decoded again (what a miss costs)."""
    for rows, cols in ((5, 13), (8, 8)):
        cached = aligned("page.png", rows, cols)
        for name in ("text.png", "camera.png", "coffee.png", "astronaut.png"):
            other = aligned(name, rows, cols)
            never = MovedImage(lambda: pytest.fail("decoded again for an unrelated image"), EXTRACTOR,  # type: ignore
                               grid=(rows, cols), factor=CELL, settings=SETTINGS)
            assert never.find_regions(features(other), features(cached)) is None


def moved_image_of(image: Image.Image) -> MovedImage:
    return MovedImage.of_image(image, EXTRACTOR, grid=(image.height // CELL, image.width // CELL), factor=CELL,
                               settings=SETTINGS)


def test_a_region_moved_out_of_reach_is_recomputed_and_left_out_of_the_similarity() -> None:
    """A frame still but for its bottom quarter, panned 9 px (a subject crossing it, past the horizontal bound): in
    place its similarity falls under the threshold (a miss before regions out of reach were told apart). Those
    regions' changed tokens are recomputed and not scored; the rest is reused in place, the guard judging the
    share. Nothing moved within reach, so the regions' search does not decode the image again."""
    a = aligned("astronaut.png", 8, 8)
    b = banded(a, [(0, 0), (0, 0), (0, 0), (0, 9)])
    fa, fb = features(a), features(b)
    assert in_place(fb, fa, SETTINGS).similarity < SETTINGS.match_threshold
    never = MovedImage(lambda: pytest.fail("decoded again with no region to move back"), EXTRACTOR,  # type: ignore
                       grid=(8, 8), factor=CELL, settings=SETTINGS)
    regions = never.find_regions(fb, fa)
    assert regions is not None and set(regions.offsets) == {(0, 0)}
    assert regions.out_of_reach == (False,) * 12 + (True,) * 4
    alignment = compare(fb, fa, SETTINGS, moved_image_of(b))
    assert alignment.similarity >= SETTINGS.match_threshold and alignment.offset == (0, 0)
    gone = regions.out_of_reach_tokens((8, 8))
    assert (alignment.changes[gone] == CHANGED).mean() > 0.9 and (alignment.changes[~gone] == SAME).all()
    plan = plan_against(fb, fa, alias="a" * 64, key="b" * 64, settings=SETTINGS, selector="attention_only",
                        layers=8, moved=moved_image_of(b))
    assert plan is not None and plan.shift == (0, 0)
    assert all(plan.change_map[i] == "x" for i in np.flatnonzero(gone & (alignment.changes == CHANGED)))
    assert not set(plan.reuse) & set(np.flatnonzero(gone & (alignment.changes == CHANGED)).tolist())


def test_regions_moved_within_reach_and_out_of_it_in_one_frame() -> None:
    """The top three quarters panned 2 px (lined up again), the bottom quarter 9 px (out of reach: recomputed)."""
    a = aligned("camera.png", 8, 8)
    b = banded(a, [(0, 2), (0, 2), (0, 2), (0, 9)])
    fa, fb = features(a), features(b)
    moved = moved_image_of(b)
    regions = moved.find_regions(fb, fa)
    assert regions is not None and regions.out_of_reach == (False,) * 12 + (True,) * 4
    assert set(regions.offsets[:12]) <= {(0, 2), (0, 0)} and regions.offsets[:12].count((0, 2)) >= 8
    assert set(regions.offsets[12:]) == {(0, 0)}
    alignment = compare(fb, fa, SETTINGS, moved)
    assert alignment.similarity >= SETTINGS.match_threshold and alignment.changed_share <= SETTINGS.max_changed_share
    assert alignment.offset == (0, 2)
    # Without the regions out of reach told apart, their changed tokens would be scored: a miss.
    scored = (alignment.changes != CHANGED) | ~regions.out_of_reach_tokens((8, 8))
    assert float(alignment.cosine[scored].mean()) > float(alignment.cosine.mean())


def test_an_unrelated_image_is_not_matched_by_calling_its_regions_out_of_reach() -> None:
    """Regions out of reach need a sure motion: unrelated images stay misses (the similarity over the rest)."""
    for rows, cols in ((5, 13), (8, 8)):
        cached = aligned("page.png", rows, cols)
        for name in ("text.png", "camera.png", "coffee.png", "astronaut.png"):
            other = aligned(name, rows, cols)
            alignment = compare(features(other), features(cached), SETTINGS, moved_image_of(other))
            assert alignment.similarity < SETTINGS.match_threshold or \
                alignment.changed_share > SETTINGS.max_changed_share
