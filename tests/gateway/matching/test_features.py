"""Per-token features: exact digests, unit descriptors, entropy, and their stored form."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from gateway.matching.features import LAYOUT_DIM, SHADE_SIDE, Cells, TokenFeatures, cell_means, token_layout
from gateway.matching.pixel import PixelExtractor
from tests.gateway.matching.pairs import CELL, aligned, changed_tokens, edited, features, jpeg
from tests.images_lib import load


def test_one_row_per_token_with_unit_vectors_and_bounded_entropy() -> None:
    image = aligned("astronaut.png", 6, 9)
    f = features(image)
    assert f.grid == (6, 9) and f.digests.shape == (54,) and f.vectors.shape == (54, PixelExtractor.dim)
    assert np.allclose(np.linalg.norm(f.vectors.astype(np.float32), axis=1), 1.0, atol=2e-3)
    assert (f.entropy >= 0).all() and (f.entropy <= 5.0).all() and f.entropy.max() > 2.0


def test_digests_are_exact_per_token() -> None:
    a = aligned("page.png", 8, 12)
    b = edited(a, (3 * CELL + 5, 2 * CELL + 5, 4 * CELL + 20, 2 * CELL + 20))
    fa, fb = features(a), features(b)
    assert ((fa.digests != fb.digests) == changed_tokens(a, b)).all()
    assert (fa.digests != fb.digests).sum() == 2  # the painted box touches two tokens


def test_blank_tokens_have_no_entropy_and_differ_from_ink() -> None:
    blank = Image.new("RGB", (4 * CELL, 2 * CELL), (255, 255, 255))
    f = features(blank)
    assert (f.entropy == 0).all() and len(set(f.digests.tolist())) == 1
    black = features(Image.new("RGB", (4 * CELL, 2 * CELL), (0, 0, 0)))
    cosine = float(f.vectors[0].astype(np.float32) @ black.vectors[0].astype(np.float32))
    assert cosine < 0  # white and black point apart, not in the same direction


def test_a_resized_image_gets_digests_of_its_source_pixels() -> None:
    image = aligned("coffee.png", 10, 14).resize((500, 357))  # no whole number of tokens: the model resizes it
    grid = (13, 18)
    first = PixelExtractor().extract(image, grid, CELL)
    again = PixelExtractor().extract(image.copy(), grid, CELL)
    assert (first.digests == again.digests).all() and len(set(first.digests.tolist())) == first.tokens
    corner = image.copy()
    corner.paste((255, 0, 0), (480, 340, 500, 357))  # the bottom-right corner only
    moved = PixelExtractor().extract(corner, grid, CELL)
    differ = np.flatnonzero(moved.digests != first.digests)
    rows, cols = np.divmod(differ, grid[1])
    assert len(differ) >= 1 and rows.min() >= grid[0] - 2 and cols.min() >= grid[1] - 2


def test_features_round_trip_and_damage_is_refused() -> None:
    f = features(aligned("chelsea.png", 5, 7))
    back = TokenFeatures.from_bytes(f.to_bytes())
    assert back.grid == f.grid and (back.digests == f.digests).all()
    assert (back.vectors == f.vectors).all() and (back.entropy == f.entropy).all()
    assert (back.shades == f.shades).all() and (back.chroma == f.chroma).all() and back.chroma.dtype == np.int16
    older = bytearray(f.to_bytes())
    older[4:6] = (2).to_bytes(2, "little")  # a record of version 2 (no chroma): dropped as damaged
    with pytest.raises(ValueError, match="version"):
        TokenFeatures.from_bytes(bytes(older))
    with pytest.raises(ValueError):
        TokenFeatures.from_bytes(f.to_bytes()[:-1])
    with pytest.raises(ValueError):
        TokenFeatures.from_bytes(b"XXXX" + f.to_bytes()[4:])


def test_regional_descriptors_are_four_unit_quadrant_means_of_the_token_layouts() -> None:
    f = features(aligned("rocket.jpg", 6, 8))
    regional = f.regional()
    grid = token_layout(f.shades, f.chroma).reshape(6, 8, LAYOUT_DIM)
    quadrants = [grid[:3, :4], grid[3:, :4]], [grid[:3, 4:], grid[3:, 4:]]
    means = np.stack([q.reshape(-1, LAYOUT_DIM).mean(axis=0) for q in (quadrants[0][0], quadrants[1][0],
                                                                      quadrants[0][1], quadrants[1][1])])
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    assert regional.shape == (4, LAYOUT_DIM) and np.allclose(regional, means, atol=1e-5)
    reencoded = features(jpeg(aligned("rocket.jpg", 6, 8))).regional()
    assert (np.einsum("rd,rd->r", regional, reencoded) > 0.99).all()
    other = features(aligned("rocket.jpg", 6, 8).transpose(Image.Transpose.FLIP_LEFT_RIGHT)).regional()
    assert not np.allclose(regional, other, atol=0.05)
    assert features(aligned("rocket.jpg", 1, 5)).regional().shape == (4, LAYOUT_DIM)  # a one-row grid


def test_a_token_layout_is_where_its_ink_is_in_half_tokens_and_its_tone() -> None:
    shades = np.full((3, SHADE_SIDE * SHADE_SIDE), 255, np.uint8)
    shades[0].reshape(SHADE_SIDE, SHADE_SIDE)[:3, :3] = 0  # ink in the top-left corner
    shades[1].reshape(SHADE_SIDE, SHADE_SIDE)[4:, 4:] = 0  # in the bottom-right one
    shades[2] = 128  # flat grey: no structure
    layout = token_layout(shades, np.zeros((3, 2), np.int16))
    assert layout.shape == (3, LAYOUT_DIM)
    structure = layout[:, :LAYOUT_DIM - 4]
    assert np.argmin(structure[0]) == 0 and np.argmin(structure[1]) == LAYOUT_DIM - 5
    assert np.allclose(structure[2], 0)
    assert layout[2, LAYOUT_DIM - 4] == pytest.approx(np.sqrt(0.2) * (128 / 255 - 0.5) / np.hypot(128 / 255 - 0.5,
                                                                                                    0.25), abs=1e-4)


def test_a_move_of_a_pixel_or_two_leaves_the_regional_descriptors_in_place() -> None:
    """The coarse stage's reason for pooling: a page scrolled by 1 or 2 px keeps its regional descriptors (the
    means of the extractor's own descriptors, 14 x 14 cells a token, move several times as far: every glyph moved
    inside its token)."""
    page = load("page.png").convert("RGB")
    a = features(page.crop((0, 0, 13 * CELL, 5 * CELL)))

    def vector_means(f: TokenFeatures) -> np.ndarray:
        grid = f.vectors.astype(np.float32).reshape(5, 13, -1)
        means = np.stack([q.reshape(-1, f.dim).mean(axis=0) for q in (grid[:2, :6], grid[:2, 6:], grid[2:, :6],
                                                                      grid[2:, 6:])])
        return means / np.linalg.norm(means, axis=1, keepdims=True)

    for offset in (1, 2):
        b = features(page.crop((0, offset, 13 * CELL, offset + 5 * CELL)))
        kept = np.einsum("rd,rd->r", a.regional(), b.regional())
        assert kept.min() > 0.99
        assert (1 - kept).max() * 5 < (1 - np.einsum("rd,rd->r", vector_means(a), vector_means(b))).max()


def test_digesting_a_large_image_holds_a_band_of_it_not_copies_of_all_of_it():
    """A 40 Mpx image cost ~350 MB more to digest than to decode (two whole copies: a conversion and numpy's);
    a band of rows at a time is all the digests need, and they are the same digests."""
    import tracemalloc

    from gateway.matching.features import token_digests

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (3000, 4000, 3), dtype=np.uint8))  # 36 MB
    tracemalloc.start()
    try:
        digests = token_digests(image, (24, 32), 28)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    # The first token's block, digested from a whole copy of the image, as before: the same digest.
    import math
    import struct

    import xxhash

    scale_y, scale_x = 3000 / (24 * 28), 4000 / (32 * 28)
    bottom = math.ceil(28 * scale_y) + math.ceil(2 * scale_y) + 1
    right = math.ceil(28 * scale_x) + math.ceil(2 * scale_x) + 1
    block = np.ascontiguousarray(np.asarray(image)[:bottom, :right])
    assert int(digests[0]) == xxhash.xxh3_64_intdigest(struct.pack("<4I", 0, bottom, 0, right) + block.tobytes())


@pytest.mark.parametrize(("height", "width"), [(896, 896), (5 * 28, 9 * 28), (7 * 32, 3 * 32), (100, 60)])
def test_cells_summed_from_finer_cells_are_the_means_cell_means_gives(height: int, width: int) -> None:
    pixels = np.random.default_rng(height * width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    summed = Cells(pixels)
    # Finest first, as the extractor asks (2 x 2, 4 x 4, then a token's cells); and grids that do not divide.
    for cell in (2, 4, 7, 8, 14, 16, 28, 32, 3):
        rows, cols = max(1, height // cell), max(1, width // cell)
        means, reference = summed.means(rows, cols), cell_means(pixels, rows, cols)
        assert means.dtype == reference.dtype and np.array_equal(means, reference), (cell, rows, cols)
    grey_cells = cell_means(pixels, height // 2, width // 2)  # float values go to cell_means as they are
    assert np.array_equal(Cells(grey_cells).means(height // 4, width // 4), cell_means(grey_cells, height // 4,
                                                                                       width // 4))
