"""The fine stage: shifts from digests, change maps against the pixels, similarity of near and unrelated pairs."""

from __future__ import annotations

import io
import random

import numpy as np

from bundled.reader.panels import changed, random_panel
from gateway.config import MatchSettings
from gateway.matching.align import CHANGED, SAME, SIMILAR, align, find_shift
from gateway.matching.features import chroma_change, shade_change
from tests.gateway.matching.pairs import CELL, aligned, changed_tokens, edited, features, jpeg

PATCH, BLANK = 0.9, 0.5
DEFAULTS = MatchSettings()


def compare(a, b, shift=None, *, patch_threshold=PATCH):
    fa, fb = features(a), features(b)
    return align(fb, fa, shift=find_shift(fb, fa) if shift is None else shift, patch_threshold=patch_threshold,
                 max_shade_change=DEFAULTS.max_shade_change, blank_entropy=BLANK)


def test_an_edit_changes_exactly_the_tokens_it_touched() -> None:
    a = aligned("page.png", 10, 16)
    b = edited(a, (5 * CELL + 3, 4 * CELL + 3, 7 * CELL + 10, 4 * CELL + 24), "new words")
    result = compare(a, b)
    truth = changed_tokens(a, b)
    assert result.shift == (0, 0)
    assert ((result.changes == CHANGED) == truth).all()  # every touched token changed, no other
    assert (result.changes[~truth] == SAME).all() and result.similarity > 0.95


def test_a_reencoded_photo_is_similar_everywhere() -> None:
    a = aligned("astronaut.png", 12, 12)
    result = compare(a, jpeg(a, 70))
    assert (result.changes != CHANGED).all() and result.count(SIMILAR) > 100 and result.similarity > 0.98


def test_a_scroll_by_whole_tokens_is_found_and_aligned() -> None:
    page = aligned("text.png", 14, 16)
    a = page.crop((0, 0, 16 * CELL, 10 * CELL))
    b = page.crop((0, 3 * CELL, 16 * CELL, 13 * CELL))  # scrolled down by three token rows
    result = compare(a, b)
    assert result.shift == (-3, 0)
    rows = np.arange(b.height // CELL * (b.width // CELL)) // 16
    assert (result.changes[rows >= 7] == CHANGED).all()  # the three rows that scrolled in have no alias token
    assert (result.changes[rows < 7] == SAME).all() and (result.alias_index[rows < 7] == np.arange(7 * 16) + 48).all()
    assert result.similarity > 0.99


def test_a_crop_along_token_lines_aligns_with_a_larger_alias() -> None:
    a = aligned("coffee.png", 10, 14)
    b = a.crop((2 * CELL, 1 * CELL, 12 * CELL, 9 * CELL))
    result = compare(a, b)
    assert result.shift == (-1, -2) and (result.changes == SAME).all()


def test_unrelated_images_do_not_look_alike() -> None:
    names = ("astronaut.png", "coffee.png", "chelsea.png", "page.png", "text.png", "camera.png")
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            result = compare(aligned(first, 10, 10), aligned(second, 10, 10))
            assert result.similarity < 0.5, (first, second, result.similarity)
            assert result.count(SAME) == 0


def test_no_shift_without_enough_agreeing_digests() -> None:
    a = aligned("camera.png", 8, 8)
    assert find_shift(features(jpeg(a)), features(a)) == (0, 0)  # a re-encode keeps no digest


def test_an_edited_glyph_is_changed_even_where_the_token_still_looks_alike() -> None:
    """A field redrawn with another word can leave a token whose descriptor barely moved (the new glyph differs
    in one corner): its cosine clears the patch threshold, its shades do not."""
    rng = random.Random(1)
    edited_tokens = high_cosine = 0
    for _ in range(150):
        panel = random_panel(rng)
        if len(panel.keys) < 2:
            continue
        near, _ = changed(panel, rng, 1)
        result = compare(panel.render(), near.render(), patch_threshold=DEFAULTS.patch_threshold)
        old, new = features(panel.render()), features(near.render())
        moved = shade_change(new.shades, old.shades) > DEFAULTS.max_shade_change
        assert (result.changes[moved] == CHANGED).all()
        edited_tokens += int(moved.sum())
        high_cosine += int((moved & (result.cosine >= DEFAULTS.patch_threshold)).sum())
    assert edited_tokens > 100 and high_cosine > 10  # the cosine alone would have let these through


def test_jpeg_noise_does_not_move_the_shades_of_text() -> None:
    for quality in (50, 75):
        panel = random_panel(random.Random(quality))
        result = compare(panel.render(), jpeg(panel.render(), quality), shift=(0, 0),
                         patch_threshold=DEFAULTS.patch_threshold)
        assert result.count(CHANGED) == 0, quality


def test_a_swatch_redrawn_in_a_colour_of_the_same_grey_is_changed() -> None:
    """Orange (245, 130, 20) and pink (245, 120, 190) differ by 14 grey levels, under the shades' tolerance: the
    token's mean colour tells them apart. JPEG noise on colour panels moves no token's colour that far."""
    from PIL import Image

    from tests.images_lib import encode

    a = Image.new("RGB", (6 * CELL, 4 * CELL), (240, 240, 240))
    a.paste((245, 130, 20), (2 * CELL + 4, CELL + 4, 3 * CELL - 4, 2 * CELL - 4))
    b = a.copy()
    b.paste((245, 120, 190), (2 * CELL + 4, CELL + 4, 3 * CELL - 4, 2 * CELL - 4))
    fa, fb = features(a), features(b)
    assert shade_change(fb.shades, fa.shades).max() <= DEFAULTS.max_shade_change  # grey alone sees nothing
    result = align(fb, fa, shift=(0, 0), patch_threshold=DEFAULTS.patch_threshold,
                   max_shade_change=DEFAULTS.max_shade_change, blank_entropy=BLANK)
    assert np.flatnonzero(result.changes == CHANGED).tolist() == [1 * 6 + 2]
    rng = random.Random(3)
    for _ in range(30):  # colour swatches and words, re-encoded: measured, no token's colour moves 4 levels
        panel = random_panel(rng)
        for quality in (50, 90):
            again = Image.open(io.BytesIO(encode(panel.render(), "JPEG", quality=quality))).convert("RGB")
            moved = chroma_change(features(again).chroma, features(panel.render()).chroma)
            assert moved.max() < DEFAULTS.max_shade_change / 4, quality
