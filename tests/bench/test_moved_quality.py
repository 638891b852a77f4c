"""bench/moved_quality.py's plan for content moved by part of a token: its shift is the motion rounded to whole
tokens, and its changed tokens are the revalued field's and those with no token to come from."""

from __future__ import annotations

import random

import pytest

from bench.moved_quality import BAND, SPLIT, SPLIT_PAN, cached_view, gateway_plan, moved_plan, moved_view, placement
from bundled.reader.panels import CELL, MAX_SIDE, Placement, changed, random_panel


def test_the_moved_plan_lines_tokens_up_with_where_their_pixels_mostly_come_from() -> None:
    rng = random.Random(4)
    a = random_panel(rng, min_fields=4, max_fields=8, max_side=MAX_SIDE - BAND)
    b, keys = changed(a, rng, 1)
    for direction, offset, shift in (("scroll", 0, (0, 0)), ("scroll", 13, (0, 0)), ("scroll", 15, (-1, 0)),
                                     ("pan", 33, (0, -1)), ("pan", 56, (0, -2))):
        where = placement(direction, offset)
        grid = where.grid(a)
        a_moved, b_moved = where.render(a), where.render(b)
        plan = moved_plan(a_moved, b_moved, grid, direction, offset)
        assert plan.shift == shift and plan.alias_grid == grid
        unaligned = {i for i in range(plan.tokens) if plan.alias_token(i) is None}
        assert len(unaligned) == -sum(shift) * (grid[1] if direction == "scroll" else grid[0])
        changed_tokens = {i for i, c in enumerate(plan.change_map) if c == "x"}
        assert unaligned <= changed_tokens and set(plan.reuse) == set(range(plan.tokens)) - changed_tokens
        assert plan.recompute_share >= len(changed_tokens) / plan.tokens
        if offset == 0:  # nothing moved: exactly the revalued field's tokens changed, the rest the same pixels
            band = BAND * (grid[1] if direction == "scroll" else 1)
            assert {i - band for i in changed_tokens} == set(b.token_indices(keys[0]))
            assert set(plan.change_map) <= {"=", "x"}
        assert changed_tokens  # the revalued field shows somewhere


def test_a_placement_keeps_the_panel_in_view_and_labels_where_its_glyphs_fell() -> None:
    panel = random_panel(random.Random(9), min_fields=3, max_fields=3, max_side=4)
    assert Placement().render(panel).tobytes() == panel.render().tobytes()
    assert Placement().token_labels(panel)[0] == {panel.token_index(key): key for key in panel.keys}
    scrolled = placement("scroll", 10)  # content 2 cells - 10 px down: its rows straddle tokens 1 and 2 below
    keys, _ = scrolled.token_labels(panel)
    cols = panel.cols
    for key in panel.keys:
        row, col = panel.cell_of(key)
        # the key glyph's centre, 14 px into its cell, is drawn 46 + 14 = 60 px below the cell's top: 2 token rows down
        assert keys[(row + 2) * cols + col] == key
    image = scrolled.render(panel)
    assert image.size == (cols * CELL, (panel.rows + BAND) * CELL)
    with pytest.raises(ValueError, match="does not fit"):
        Placement(top=CELL + 1, pad=(1, 0))
    with pytest.raises(ValueError, match="keep the panel in view"):
        placement("pan", BAND * CELL + 1)


def test_the_gateway_plans_scrolls_by_any_part_of_a_token_but_half_and_pans_up_to_5_px_off_the_grid() -> None:
    """One panel the coarse stage offers after every one of these moves is planned at each, with the whole-token
    shift (on these small panels the coarse stage lets most moves by: the README's table); a pan 7 to 21 px off
    the grid (where reuse was not measured to hold) and a move by half a token (a tie: which token the content came
    from) are never planned, for any panel of ten."""
    for seed in range(10):
        rng = random.Random(seed)
        a = random_panel(rng, min_fields=4, max_fields=8, max_side=MAX_SIDE - BAND)
        b, _ = changed(a, rng, 1)
        for direction in ("scroll", "pan"):
            cached, grid = placement(direction, 0).render(a), placement(direction, 0).grid(a)
            if seed == 9:
                planned = ((0, 0), (1, 0), (2, 0), (5, 0), (25, -1), (27, -1), (29, -1), (33, -1))
                if direction == "scroll":
                    planned += ((7, 0), (13, 0), (15, -1), (18, -1), (41, -1), (43, -2))
                for offset, shift in planned:
                    plan = gateway_plan(cached, placement(direction, offset).render(b), grid)
                    assert plan is not None, (direction, offset)
                    assert plan.shift == ((shift, 0) if direction == "scroll" else (0, shift))
            for offset in (14, 42) if direction == "scroll" else (7, 10, 14, 18, 21, 42):  # 14, 42: half a token
                    assert gateway_plan(cached, placement(direction, offset).render(b), grid) is None, \
                        (seed, direction, offset)


def test_a_split_pans_the_top_half_and_scrolls_the_bottom_half_and_the_gateway_plans_it_region_by_region() -> None:
    import numpy as np

    panel = random_panel(random.Random(3), min_fields=6, max_fields=10, max_side=MAX_SIDE - BAND)
    cached = cached_view(SPLIT, panel)
    grid = (cached.height // CELL, cached.width // CELL)
    assert grid == (panel.rows + BAND, panel.cols + BAND)
    split = moved_view(SPLIT, 5, panel)
    middle = grid[0] // 2 * CELL
    rest = BAND * CELL
    scrolled = Placement(top=rest - 5, left=rest, pad=(BAND, BAND)).render(panel)
    panned = Placement(top=rest, left=rest - SPLIT_PAN, pad=(BAND, BAND)).render(panel)
    assert np.array_equal(np.asarray(split)[:middle], np.asarray(panned)[:middle])
    assert np.array_equal(np.asarray(split)[middle:], np.asarray(scrolled)[middle:])
    with pytest.raises(ValueError, match="under half a token"):
        moved_view(SPLIT, 14, panel)
    b, _ = changed(panel, random.Random(3), 1)
    plan = gateway_plan(cached, moved_view(SPLIT, 5, b), grid)
    assert plan is not None and plan.shift == (0, 0)  # one motion lines up neither half; a motion per region does
    ideal = moved_plan(moved_view(SPLIT, 5, panel), moved_view(SPLIT, 5, b), grid, SPLIT, 5)
    assert ideal.shift == (0, 0) and "x" in ideal.change_map
