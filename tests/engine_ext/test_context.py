"""engine_ext.executor.context.TensorParallel without SGLang: which heads each rank reads, and the heads gathered
from every rank put back in the model's order, replicated heads once (the exchanges themselves run in
tests/engine_ext/test_tensor_parallel.py, between the ranks of a real worker)."""

from __future__ import annotations

import pytest
import torch

from engine_ext.executor.context import TensorParallel


class Ranks:
    """All ranks' tensors at once: all_gather concatenates them along dim, in rank order, as SGLang's does."""

    def __init__(self, per_rank: list[torch.Tensor]) -> None:
        self.per_rank = per_rank

    def all_gather(self, _mine: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self.per_rank, dim=dim)


@pytest.mark.parametrize(("kv_heads", "size"), [(8, 2), (4, 4), (2, 4), (1, 2)])
def test_every_head_comes_back_once_in_order(kv_heads: int, size: int) -> None:
    model = torch.randn(3, 5, kv_heads, 4)  # (layers, tokens, heads, head_dim)
    ranks = [TensorParallel(rank, size, kv_heads) for rank in range(size)]
    per_rank = [model[:, :, r.heads[0] : r.heads[1]] for r in ranks]
    assert all(p.shape[2] == max(1, kv_heads // size) for p in per_rank)
    for rank in ranks:
        rank.group = Ranks(per_rank)
        assert torch.equal(rank.gather_heads(per_rank[rank.rank]), model)
    assert [r.leader for r in ranks] == [True] + [False] * (size - 1)
    assert ranks[0].read_heads == ranks[0].heads


def test_one_rank_exchanges_nothing() -> None:
    alone = TensorParallel(kv_heads=2)
    assert alone.read_heads is None and alone.heads == (0, 2) and alone.leader
    assert alone.agree(False) is False and alone.agree_cause("entry_missing") == "entry_missing"
    score = torch.arange(4.0)
    assert alone.total(score) is score
