"""Which KV heads a tensor-parallel rank holds: the head range it passes to ``get_sparse(..., heads=...)``.

SGLang's rule (sglang 0.5.23, the package this project installs), in ``QKVParallelLinear``:

- ``srt/layers/linear.py:1140-1145``: with ``kv_tp_size >= total_num_kv_heads`` each rank keeps one KV head and
  ``num_kv_head_replicas = kv_tp_size // total_num_kv_heads`` ranks share it; else each keeps
  ``total_num_kv_heads // kv_tp_size`` heads (``divide``: SGLang refuses sizes that do not divide, and so does
  ``srt/models/qwen2.py:170-177``).
- ``srt/layers/linear.py:1502-1503`` (and ``srt/layers/parameter.py:248`` for the v2 loader): the K and V rows a
  rank loads start at ``(kv_tp_rank // num_kv_head_replicas) * num_kv_heads`` heads.

So rank r of N holds heads [r*H/N, (r+1)*H/N) when H >= N, and the one head r // (N/H) when H < N. ``tp_size`` is
the size of the group the K/V projection is split over: SGLang's tensor-parallel size for the Qwen models (they
pass no separate KV group).
"""

from __future__ import annotations


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def rank_heads(kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """The half-open range of KV heads that tensor-parallel rank ``rank`` of ``tp_size`` holds for a model with
    ``kv_heads`` KV heads, by SGLang's rule (see the module docstring): one head wide when ``kv_heads < tp_size``
    (heads replicated across ranks). Raises ValueError for non-positive sizes, a rank outside [0, tp_size), or sizes
    SGLang itself refuses (neither divides the other as it needs)."""
    kv_heads, tp_size, rank = _count("kv_heads", kv_heads), _count("tp_size", tp_size), _count("rank", rank)
    if kv_heads < 1 or tp_size < 1:
        raise ValueError(f"kv_heads and tp_size must be positive, got kv_heads={kv_heads} tp_size={tp_size}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside [0, {tp_size})")
    if kv_heads >= tp_size:
        if kv_heads % tp_size:
            raise ValueError(f"{kv_heads} KV heads do not split over {tp_size} ranks (SGLang refuses this too)")
        per_rank = kv_heads // tp_size
        return rank * per_rank, (rank + 1) * per_rank
    if tp_size % kv_heads:
        raise ValueError(f"{tp_size} ranks do not share {kv_heads} KV heads evenly (SGLang refuses this too)")
    head = rank // (tp_size // kv_heads)  # num_kv_head_replicas ranks hold each head
    return head, head + 1
