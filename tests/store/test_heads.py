"""rank_heads: the KV heads each tensor-parallel rank holds, by SGLang's rule (store/heads.py cites it)."""

from __future__ import annotations

import pytest

from store import rank_heads


@pytest.mark.parametrize("kv_heads,tp_size,expected", [
    (8, 2, [(0, 4), (4, 8)]),  # split
    (8, 8, [(h, h + 1) for h in range(8)]),
    (4, 8, [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4), (3, 4)]),  # replicated: 2 ranks per head
    (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
    (1, 4, [(0, 1)] * 4),
    (8, 1, [(0, 8)]),
    (1, 1, [(0, 1)]),
])
def test_rank_heads_follows_sglang(kv_heads, tp_size, expected):
    assert [rank_heads(kv_heads, tp_size, rank) for rank in range(tp_size)] == expected


def test_split_heads_cover_every_head_once():
    for kv_heads, tp_size in ((8, 2), (8, 4), (16, 8), (32, 8)):
        ranges = [rank_heads(kv_heads, tp_size, rank) for rank in range(tp_size)]
        assert [h for a, b in ranges for h in range(a, b)] == list(range(kv_heads))


@pytest.mark.parametrize("args,match", [
    ((0, 2, 0), "positive"), ((8, 0, 0), "positive"), ((-4, 2, 0), "positive"),
    ((8, 2, 2), "outside"), ((8, 2, -1), "outside"), ((4, 8, 8), "outside"),
    ((6, 4, 0), "do not split"), ((3, 4, 0), "evenly"),
    ((8.0, 2, 0), "int"), ((8, True, 0), "int"), ((8, 2, "1"), "int"),
])
def test_rank_heads_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        rank_heads(*args)
