"""bench/moved_quality.py's plan for content moved by part of a token: its shift is the motion rounded to whole
tokens, and its changed tokens are the revalued field's and those with no token to come from."""

from __future__ import annotations

import random

from bench.moved_quality import moved, moved_plan
from bundled.reader.panels import changed, random_panel


def test_the_moved_plan_lines_tokens_up_with_where_their_pixels_mostly_come_from() -> None:
    rng = random.Random(4)
    a = random_panel(rng, min_fields=4, max_fields=8)
    b, keys = changed(a, rng, 1)
    grid = (a.rows, a.cols)
    field_tokens = set(b.token_indices(keys[0]))
    for direction, offset, shift in (("scroll", 0, (0, 0)), ("scroll", 13, (0, 0)), ("scroll", 15, (-1, 0)),
                                     ("pan", 33, (0, -1))):
        a_moved = moved(a.render(), direction, offset, a.background)
        b_moved = moved(b.render(), direction, offset, b.background)
        plan = moved_plan(a_moved, b_moved, grid, direction, offset)
        assert plan.shift == shift and plan.alias_grid == grid
        unaligned = {i for i in range(plan.tokens) if plan.alias_token(i) is None}
        assert len(unaligned) == (0 if shift == (0, 0) else a.cols if direction == "scroll" else a.rows)
        changed_tokens = {i for i, c in enumerate(plan.change_map) if c == "x"}
        assert unaligned <= changed_tokens and set(plan.reuse) == set(range(plan.tokens)) - changed_tokens
        assert plan.recompute_share >= len(changed_tokens) / plan.tokens
        if offset == 0:  # nothing moved: exactly the revalued field's tokens changed, the rest the same pixels
            assert changed_tokens == field_tokens and set(plan.change_map) <= {"=", "x"}
        assert changed_tokens  # the revalued field shows somewhere
